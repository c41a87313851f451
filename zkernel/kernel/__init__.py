"""The runtime: builds the plugin managers, wires the engine, fires the hooks.

`plugin_manager` (installed plugins, selected components), `bootstrap`
(`initialize`), `engine` (the object the user drives), `scheduler` (when each
group is fetched and released in a pass), `step_pipeline` (the optimizer step
per group with look-ahead), and their internals: module trace, look-ahead,
gradient readiness and reduction order, rank divergence, loss scaling,
lifecycle. Nothing here names a builtin plugin.
"""
