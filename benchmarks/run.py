"""`make bench`: every benchmark, results as JSON (and plots) in benchmarks/results/."""

from benchmarks import (
    bench_ar,
    bench_ar_cpu,
    bench_ar_variants,
    bench_audio_core,
    bench_conversation,
    bench_endpoint,
    bench_prepare,
    bench_speech,
)


def main() -> None:
    for bench in (
        bench_audio_core,
        bench_prepare,
        bench_speech,
        bench_ar,
        bench_ar_cpu,
        bench_ar_variants,
        bench_conversation,
        bench_endpoint,
    ):
        print(f"== {bench.__name__}", flush=True)
        bench.main()


if __name__ == "__main__":
    main()
