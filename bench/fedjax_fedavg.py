"""FedJAX's FedAvg on graphfl's engine-bench task shape: the comparator row of ``graphfl bench engine``.

Runs in a Python that has FedJAX 0.0.17 and its JAX stack (``scripts/install-fedjax.sh`` makes
one), not graphfl's: it imports nothing from graphfl. The bench starts it as a subprocess with
``GRAPHFL_FEDJAX_PYTHON`` and reads the JSON object it prints as its last line.

Task shape (graphfl's synthetic-multicenter row): per client 100 samples ``x ∈ R⁸``, ``y ∈ R⁸``
(a random linear map plus noise, a different map per client); model ``8 → 16 → 16 → 8`` without
biases, sigmoid after the two hidden layers, mean squared error; FedAvg
(``fedjax.algorithms.fed_avg``) with every client in every round, client SGD (``lr``) for
``steps`` steps of batch ``batch`` (``ShuffleRepeatBatchHParams``), server SGD with step 1 (the
plain weighted mean of the client models).

Printed: ``round_s`` (median wall seconds of rounds 2..R: round 1 compiles), ``first_round_s``,
``import_s`` (importing JAX and FedJAX), ``setup_s`` (from the start of the script until round 1
begins, plus round 1's compile time ``first_round_s − round_s``), ``clients``, ``rounds`` and
the versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

T_START = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 compiles)")

    import fedjax
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np
    from fedjax.algorithms import fed_avg

    t_imported = time.perf_counter()

    def forward(x: jnp.ndarray) -> jnp.ndarray:
        h = jax.nn.sigmoid(hk.Linear(16, with_bias=False)(x))
        h = jax.nn.sigmoid(hk.Linear(16, with_bias=False)(h))
        return hk.Linear(8, with_bias=False)(h)

    def per_example_mse(batch: dict, preds: jnp.ndarray) -> jnp.ndarray:
        return jnp.mean((preds - batch["y"]) ** 2, axis=-1)

    model = fedjax.create_model_from_haiku(
        transformed_forward_pass=hk.transform(lambda batch: forward(batch["x"])),
        sample_batch={"x": np.zeros((1, 8), np.float32)}, train_loss=per_example_mse)

    rng = np.random.default_rng(args.seed)
    clients = []
    for cid in range(args.clients):
        a = rng.normal(size=(8, 8)).astype(np.float32) / np.sqrt(8)
        x = rng.normal(size=(args.samples, 8)).astype(np.float32)
        y = (x @ a + 0.1 * rng.normal(size=(args.samples, 8))).astype(np.float32)
        clients.append((str(cid).encode(), fedjax.ClientDataset({"x": x, "y": y})))

    algorithm = fed_avg.federated_averaging(
        grad_fn=fedjax.model_grad(model),
        client_optimizer=fedjax.optimizers.sgd(args.lr),
        server_optimizer=fedjax.optimizers.sgd(1.0),
        client_batch_hparams=fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch, num_epochs=None,
                                                              num_steps=args.steps))
    state = algorithm.init(model.init(jax.random.PRNGKey(args.seed)))
    key = jax.random.PRNGKey(args.seed + 1)
    t_setup = time.perf_counter()
    seconds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        key, sub = jax.random.split(key)
        keys = jax.random.split(sub, len(clients))
        state, _ = algorithm.apply(state, [(cid, ds, k) for (cid, ds), k in zip(clients, keys)])
        jax.tree_util.tree_map(lambda a: a.block_until_ready(), state.params)
        seconds.append(time.perf_counter() - t0)
    round_s = statistics.median(seconds[1:])
    print(json.dumps({
        "clients": args.clients, "rounds": args.rounds, "round_s": round_s, "first_round_s": seconds[0],
        "import_s": t_imported - T_START, "setup_s": (t_setup - T_START) + (seconds[0] - round_s),
        "seconds": seconds, "fedjax": getattr(fedjax, "__version__", None) or _version("fedjax"),
        "jax": jax.__version__, "steps": args.steps, "batch": args.batch, "samples": args.samples,
    }))


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
