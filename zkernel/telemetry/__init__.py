"""What zkernel reports: structured logging, the step timeline, traces, progress.

`log` (the quiet library logger), `timeline` (where a step's time goes),
`chrome_trace`, `gpu_clock`, `intervals`, `profiling`
(`torch.profiler.record_function` ranges), `progress` (bars for long waits).
"""
