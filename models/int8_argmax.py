"""`Int8Argmax`: the argmax of ``x @ W.T`` over a large vocabulary, exactly as in
float32, while reading the weights as int8.

Greedy decoding needs only the best token of each step, yet the vocabulary projection
reads the whole matrix (Whisper tiny: 51,864 x 384 float32, 80 MB) for every token: most
of an ASR pass. Here the rows are kept as int8 too, one scale per row, and a step reads
those (20 MB, through onnxruntime's integer matrix product, `MatMulInteger`); with ``x``
quantized to int8 as well, the integer product is exact, and each row's error against
the float32 logit is bounded by what the two roundings can add:

    logit_j - screen_j = s_j (delta . q_j) + x . e_j
    |...| <= s_j / 2 * (s_x * |q_j|_1 + |x|_1)

(``q_j``, ``s_j``: row j in int8 and its scale, ``e_j`` its rounding, below ``s_j / 2``
in each element; ``s_x``, ``delta``: the same for ``x``, ``delta`` below ``s_x / 2``).
Every row whose upper bound reaches the best lower bound is a candidate; the others
cannot win. The candidates' float32 logits decide, so the token is the float32
argmax's (ties to the lowest index, as `numpy.argmax`); usually a handful of rows are
left.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from models.onnx_cpu import cpu_session

Array = npt.NDArray[np.float32]

# what float32 rounding may add to the screen (products of ~400 terms, scaled twice):
# taken far above it, at the cost of a candidate more now and then
_RELATIVE_MARGIN = np.float32(1e-3)
_ABSOLUTE_MARGIN = np.float32(1e-3)


def _product_model(weights: npt.NDArray[np.int8]) -> bytes:
    """An ONNX model: int32 [rows, vocabulary] = (A uint8 [rows, width] - 128) @ Q.T,
    ``weights`` being Q (the transpose is folded once, when the session is made, not in
    numpy, where an int8 transpose of Whisper's vocabulary is a slow part of start-up:
    docs/performance.md, "The vocabulary projection read as int8")."""
    from onnx import TensorProto, helper, numpy_helper

    vocabulary, width = weights.shape
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["q"], ["q_t"], perm=[1, 0]),
            helper.make_node("MatMulInteger", ["a", "q_t", "zero"], ["out"]),
        ],
        "int8_argmax",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["rows", width])],
        [helper.make_tensor_value_info("out", TensorProto.INT32, ["rows", vocabulary])],
        [numpy_helper.from_array(weights, "q"), numpy_helper.from_array(np.array(128, np.uint8), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


class Int8Argmax:
    def __init__(self, weights: Array) -> None:
        """``weights``: [vocabulary, width] float32 (a row per token)."""
        self.weights = np.ascontiguousarray(weights, np.float32)
        peak = np.abs(self.weights).max(1)
        self.scale = np.where(peak > 0, peak / 127, 1).astype(np.float32)
        quantized = np.rint(self.weights / self.scale[:, None]).astype(np.int8)
        self.l1 = np.abs(quantized, dtype=np.int32).sum(1, dtype=np.int32).astype(np.float32)
        self._session = cpu_session(_product_model(quantized))
        self.candidates = 0  # rows whose float32 logits were computed, over all calls

    def argmax(self, x: Array, banned: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The index of each row of ``x`` [rows, width]'s largest logit, ``banned``
        indices left out: `numpy.argmax` of the float32 ``x @ weights.T`` with those
        set to -inf."""
        best = np.empty(x.shape[0], np.int64)
        if not x.shape[0]:
            return best
        peak = np.abs(x).max(1)
        s_x = np.where(peak > 0, peak / 127, 1).astype(np.float32)
        a = (np.rint(x / s_x[:, None]) + 128).astype(np.uint8)
        (integer,) = self._session.run(None, {"a": a})
        for r in range(x.shape[0]):
            screen = integer[r].astype(np.float32) * (s_x[r] * self.scale)
            bound = self.scale * (np.float32(0.5) * (s_x[r] * self.l1 + np.abs(x[r]).sum(dtype=np.float32)))
            bound += _RELATIVE_MARGIN * (np.abs(screen) + bound) + _ABSOLUTE_MARGIN
            low = screen - bound
            low[banned] = -np.inf
            high = screen + bound
            high[banned] = -np.inf
            candidates = np.flatnonzero(high >= low.max())
            self.candidates += candidates.size
            logits = self.weights[candidates] @ x[r]
            best[r] = candidates[int(np.argmax(logits))]
        return best
