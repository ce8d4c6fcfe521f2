"""Every LLM variant on this CPU: `duplex bench ar-variants`, with a plot."""

from __future__ import annotations

import numpy as np

from benchmarks.common import duplex_bench, new_plot, save_plot, write_result


def main() -> None:
    result = duplex_bench("ar-variants")
    print(write_result("ar_variants", result))
    measured = {name: r for name, r in result["variants"].items() if "decode_tok_s" in r}
    fig, ax = new_plot()
    x = np.arange(len(measured))
    for offset, key, label in (
        (-0.2, "decode_tok_s", "decode, 1 sequence"),
        (0.2, "batched_8_tok_s", "8 batched / 8"),
    ):
        scale = 8 if key == "batched_8_tok_s" else 1
        ax.bar(x + offset, [r[key] / scale for r in measured.values()], width=0.4, label=label)
    names = [name + ("" if r["correct"] else " (wrong)") for name, r in measured.items()]
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
    cpu = result["cpu"]
    save_plot(
        fig, ax, "ar_variants", f"LLM variants on {cpu['model']} ({cpu['kind']})", "tokens/s per sequence"
    )


if __name__ == "__main__":
    main()
