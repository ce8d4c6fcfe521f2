"""``duplex bench``: stage benchmarks that print one JSON object as their last line."""

from __future__ import annotations

import argparse
import json

from duplex.config import Config


def run_bench(config: Config, args: argparse.Namespace) -> int:
    sessions = [int(n) for n in args.sessions.split(",") if n.strip()]
    if args.stage == "ar":
        from duplex.bench.ar import bench_ar

        result = bench_ar(config, sessions, quick=args.quick)
    elif args.stage == "ar-cpu":
        from duplex.bench.ar_cpu import bench_ar_cpu

        result = bench_ar_cpu(config, quick=args.quick)
    elif args.stage == "ar-variants":
        from duplex.bench.ar_variants import bench_ar_variants

        only = [v for v in args.variants.split(",") if v.strip()]
        result = bench_ar_variants(config, quick=args.quick, only=only)
    elif args.stage == "conversation":
        from duplex.bench.conversation import bench_conversation

        result = bench_conversation(config, sessions, args.utterances, args.turns)
    elif args.stage == "endpoint":
        from duplex.bench.endpoint import bench_endpoint

        result = bench_endpoint(config, turns=args.turns or 10)
    elif args.stage == "asr":
        from duplex.bench.asr import bench_asr

        result = bench_asr(config, sessions, quick=args.quick)
    else:
        from duplex.bench.tts import bench_tts

        result = bench_tts(config, sessions, quick=args.quick)
    print(json.dumps(result))
    return 0
