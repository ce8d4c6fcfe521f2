"""AR stage on the CPU: `duplex bench ar-cpu`, vLLM against llama.cpp, with a plot."""

from __future__ import annotations

import numpy as np

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result


def main() -> None:
    result = duplex_bench("ar-cpu")
    print(write_result("ar_cpu", result))
    fig, ax = new_plot()
    groups = [("1 sequence", result["decode_tok_s"])]
    groups += [(f"{n} batched", result["batched_tok_s"][n]) for n in ("1", "4", "8")]
    x = np.arange(len(groups))
    for offset, engine, label in (
        (-0.2, "vllm", "vLLM (the service's engine)"),
        (0.2, "llamacpp", "llama.cpp"),
    ):
        ax.bar(x + offset, [g[1][engine] for g in groups], width=0.4, label=label)
    ax.set_xticks(x, [g[0] for g in groups])
    save_plot(fig, ax, "ar_cpu_decode", "Decode on the CPU: vLLM and llama.cpp, same weights", "tokens/s")


if __name__ == "__main__":
    main()
