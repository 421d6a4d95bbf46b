"""ocannl.summary: one call prints every parameter under its block with its shape, count and
bytes, each cast twin under its master, and the bytes by precision."""

from __future__ import annotations

import io

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import mixed_prec, nn_blocks
from ocannl.summary import summary


def _model():
    x = T.term(np.zeros((4, 6)), label="x", prec="f16")

    def f():
        return nn_blocks.mlp(x, [5], 3, label="net")[0]

    logits = T.cast(mixed_prec.with_master_weights(prec="f16", f=f), "f32")
    h, _, _ = nn_blocks.layer_norm(logits, label="ln")
    return h


def test_summary_lists_parameters_by_block_with_shapes_counts_and_bytes():
    out = io.StringIO()
    text = summary(_model(), file=out)
    assert out.getvalue() == text + "\n"
    lines = text.splitlines()
    assert lines[0].endswith(": 6 parameters, 59 values")  # 30 + 5 + 15 + 3 + 3 + 3
    rows = [line.split() for line in lines[3:-1]]
    assert rows == [
        ["net", "net_w0", "|6->5", "30", "f32", "master", "120"],
        ["net_w0_f16", "|6->5", "30", "f16", "twin", "60"],
        ["net_b0", "|->5", "5", "f32", "master", "20"],
        ["net_b0_f16", "|->5", "5", "f16", "twin", "10"],
        ["net_w1", "|5->3", "15", "f32", "master", "60"],
        ["net_w1_f16", "|5->3", "15", "f16", "twin", "30"],
        ["net_b1", "|->3", "3", "f32", "master", "12"],
        ["net_b1_f16", "|->3", "3", "f16", "twin", "6"],
        ["ln", "ln_gamma", "|->3", "3", "f32", "param", "12"],
        ["ln_beta", "|->3", "3", "f32", "param", "12"],
    ]
    assert lines[-1] == ("bytes by precision: f32 masters 212 bytes (53 values); f32 params "
                         "24 bytes (6 values); f16 twins 106 bytes (53 values; local to "
                         "routines)")


def test_nested_blocks_are_joined_and_state_buffers_listed():
    x = T.term(np.zeros((4, 8, 8, 1)), label="x", batch_dims=(4,), output_dims=(8, 8, 1))
    logits, _ = nn_blocks.lenet(x, num_classes=10, channels=(2, 3), hidden=4, label="le")
    y, _ = nn_blocks.batch_norm(logits, train=True, label="bn")
    text = summary(y, file=None)
    assert "le/le_conv0  le_conv0_kernel  |3,3,1->2" in text
    assert "le/le_fc     le_fc_w0" in text
    assert text.splitlines()[-1] == "state buffers: bn_running_mean (10,) f32, " \
                                    "bn_running_var (10,) f32"


def test_summary_refuses_what_is_no_tensor():
    with pytest.raises(TypeError, match="summary expects a Tensor"):
        summary([1, 2], file=None)
