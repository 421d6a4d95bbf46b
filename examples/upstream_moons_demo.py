"""Upstream OCANNL's half-moons demo (``test/training/moons_demo.ml`` at ``c338ea3``), ported
line for line: the same model, loss, learning-rate decay, weight decay, batch size and epochs,
and every dim upstream leaves to inference left out here too.

The translation: OCaml's ``*`` (tensor product) is ``@``, ``*.`` is ``*``; ``{w}`` is
``T.param("w")`` inside a ``@T.op`` function (made at its first call, shared by the next);
``{b; o = [16]}`` is ``T.param("b", output_dims=[16])``; ``x ++ "spec"`` is
``T.einsum("spec", x)``; ``!..n`` is the number ``n``; ``TDSL.rebatch`` is ``T.rebatch`` and
``moons_flat @| batch_n`` is ``T.batch_slice(moons_flat, batch_n)``, ``batch_n`` a
``T.static_index`` the loop sets before each run (upstream's ``Train.sequential_loop`` over
the routine's bindings): the data stays whole on the device, one routine reads each batch.

Run: ``python examples/upstream_moons_demo.py`` (prints the loss every 10 epochs, then the
training accuracy).
"""

from __future__ import annotations

import sys

import numpy as np

import ocannl.tensor as T
from ocannl import Context, datasets, train


def main(epochs: int = 80, seed: int = 2) -> float:
    T.set_seed(seed)
    batch_size = 10
    len_ = batch_size * 40
    n_batches = 2 * len_ // batch_size
    steps = epochs * 2 * len_ // batch_size
    coordinates, labels = datasets.half_moons(2 * len_, noise=0.1, seed=seed)
    classes = (2.0 * labels - 1.0).astype(np.float32).reshape(-1, 1)  # upstream's ±1 labels
    batch_n = T.static_index("batch_n", range=n_batches)
    moons_flat = T.rebatch(coordinates, batch=batch_size, label="moons_flat")
    moons_classes = T.rebatch(classes, batch=batch_size, label="moons_classes")

    @T.op
    def mlp(x: T.Tensor) -> T.Tensor:
        # { w3 } * relu ({ b2; o = [ 16 ] } + ({ w2 } * relu ({ b1; o = [ 16 ] } + ({ w1 } * x))))
        return T.param("w3") @ T.relu(T.param("b2", output_dims=[16]) + (
            T.param("w2") @ T.relu(T.param("b1", output_dims=[16]) + (T.param("w1") @ x))))

    moons_input = T.batch_slice(moons_flat, batch_n)
    moons_class = T.batch_slice(moons_classes, batch_n)
    margin_loss = T.relu(1 - (moons_class * mlp(moons_input)))
    weight_decay = 0.0001
    scalar_loss = T.einsum("...|... => 0", margin_loss) / batch_size
    update = train.grad_update(scalar_loss)
    # learning_rate = 0.1 *. ((2 *. !..steps) - !@step_n) /. !..steps, set at every step
    learning_rate = T.term(np.float32(0.2), label="learning_rate")
    sgd = train.sgd_update(scalar_loss, learning_rate=learning_rate,
                           weight_decay=weight_decay)
    ctx = train.init_params(Context.cpu(), scalar_loss)
    ctx, sgd_routine = ctx.compile(update + sgd)
    step = 0
    for epoch in range(1, epochs + 1):
        epoch_loss = 0.0
        for batch in range(n_batches):
            ctx = ctx.set_values(learning_rate, [0.1 * (2 * steps - step) / steps])
            ctx = ctx.set_values(batch_n, [batch]).run(sgd_routine)
            epoch_loss += float(ctx.get_values(scalar_loss)[0])
            step += 1
        if epoch % 10 == 0 or epoch == 1:
            print(f"epoch {epoch}: epoch loss {epoch_loss:.4f}")

    point = T.term(coordinates, label="point")  # upstream classifies one point per call
    ctx, result_routine = ctx.compile(train.forward(mlp_result := mlp(point)))
    ctx = ctx.run(result_routine)
    predicted = ctx.get_values(mlp_result)[:, 0] >= 0.0
    accuracy = float(np.mean(predicted == (labels > 0)))
    print(f"training accuracy: {accuracy:.2%}")
    print(f"mlp's parameters: {', '.join(f'{p.label} {p.shape}' for p in mlp.params)}")
    return accuracy


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
