"""Host time of the stream calls every gather, reduction and event makes: torch's against zkernel's.

    python bench/stream_calls.py            # needs one CUDA device

With one unit per module a ZeRO-3 step makes about 1,000 of these calls ([Note: stream calls on
the hot path] in `zkernel/streams.py`). Each line prints the microseconds per call of torch's form
(the anchor), of `zkernel.platform.streams`' form, and their ratio, from the same run (median of 5 rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _per_call_us(fn, calls: int) -> float:
    for _ in range(1000):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/stream_calls.py needs a CUDA device")
    from zkernel.platform.streams import current_stream, record_event, use_stream

    stream = torch.cuda.Stream()

    def switch_torch():
        with torch.cuda.stream(stream):
            pass

    def switch_ours():
        with use_stream(stream):
            pass

    def event_torch():
        if not torch.cuda.is_available():
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    pairs = {
        "current stream": (torch.cuda.current_stream, current_stream),
        "stream switch, in and out": (switch_torch, switch_ours),
        "event on the current stream": (event_torch, record_event),
    }
    print(f"{'call':30} {'torch us':>9} {'zkernel us':>11} {'ratio':>6}")
    for name, (theirs, ours) in pairs.items():
        a, b = _per_call_us(theirs, args.calls), _per_call_us(ours, args.calls)
        print(f"{name:30} {a:9.2f} {b:11.2f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
