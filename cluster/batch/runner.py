"""The batch driver: input lines -> Ray dataset -> `map_batches` over engine replicas -> output.

The driver reads and checks the input (it needs every row's ID for `--resume`), hands the rows to
Ray Data, which spreads them over an actor pool of `replicas` `EngineReplica`s (one engine each),
and writes the rows coming back to the output file in input order. The same code runs on a laptop
(a local Ray instance is started on loopback) and on a cluster (inside `ray job submit` the driver
joins it), since Ray Data places the replicas.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from cluster.batch.openai_rows import OutputFormat
from cluster.batch.output import OutputWriter, prepare_output
from cluster.batch.rows import BatchItem, parse_line
from cluster.config.engine_args import EngineArgs, resolve_executor_backend
from cluster.ray_cluster import connect

LOOPBACK_IP = "127.0.0.2" if sys.platform.startswith("linux") else "127.0.0.1"
"""Ray replaces 127.0.0.1 with the machine's address on Linux; the rest of 127/8 stays local."""


class BatchFailed(RuntimeError):
    """The run stopped (a replica could not start or died); the rows written so far are kept."""


@dataclass(frozen=True)
class BatchOptions:
    """One batch run."""

    input: Path
    output: Path
    engine_args: EngineArgs
    replicas: int = 1
    batch_size: int = 64
    """Rows one replica call queues together."""
    continue_on_error: bool = False
    resume: bool = False
    address: str | None = None
    """Ray cluster to join; default RAY_ADDRESS (set inside `ray job submit`), else a local one."""
    output_format: OutputFormat = "openai"
    """openai: OpenAI input lines come back as OpenAI batch output lines (Ray Data LLM rows keep
    their columns); columns: every line as Ray Data LLM columns."""


@dataclass(frozen=True)
class BatchSummary:
    """What a run did."""

    output: Path
    ok: int
    errored: int
    skipped: int
    generated_tokens: int
    seconds: float

    def line(self) -> str:
        rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        skipped = f", {self.skipped} rows already done" if self.skipped else ""
        return (
            f"batch: {self.ok} rows ok, {self.errored} rows errored{skipped}, "
            f"{self.generated_tokens} tokens generated in {self.seconds:.1f} s "
            f"({rate:.0f} tokens/s) -> {self.output}"
        )


def read_items(path: Path, done: set[str]) -> tuple[list[BatchItem], int]:
    """The input's rows not in `done` (blank lines skipped), and how many were skipped as done."""
    items: list[BatchItem] = []
    seen: set[str] = set()
    skipped = 0
    with path.open(encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            item = parse_line(index, line)
            if item.key in done:
                skipped += 1
                continue
            if item.key in seen:
                item = dataclasses.replace(
                    item, request=None, error=f"duplicate {item.id_key} {item.row_id!r}"
                )
            seen.add(item.key)
            items.append(item)
    return items, skipped


def connect_ray(address: str | None) -> None:
    """Join `address`, RAY_ADDRESS or the cluster `ray start` runs here, else start a local
    Ray instance on loopback (`cluster.ray_cluster.connect`)."""
    connect(address, node_ip_address=LOOPBACK_IP)


def replica_args(args: EngineArgs) -> EngineArgs:
    """The engine arguments of one replica: its ranks run inside the replica actor."""
    backend = resolve_executor_backend(args, "batch_replica")
    return args.model_copy(update={"distributed_executor_backend": backend})


def check_pool_fits(replicas: int, gpus_per_replica: int, cluster: dict[str, float]) -> None:
    """ValueError at once when the cluster can never hold the replica pool (1 CPU each, and
    the GPUs of its ranks), instead of a job that waits forever."""
    needs = {"CPU": float(replicas), "GPU": float(replicas * gpus_per_replica)}
    for name, amount in needs.items():
        if amount > cluster.get(name, 0):
            raise ValueError(
                f"--replicas {replicas} needs {amount:g} {name} for the engine replicas and the "
                f"cluster has {cluster.get(name, 0):g}: lower --replicas or add nodes"
            )


def _run_rows(options: BatchOptions, items: list[BatchItem]) -> Iterator[str]:
    """The output rows (JSON) of `items`, in input order, computed by the replica pool."""
    import ray
    import ray.data

    from cluster.batch.replica import EngineReplica

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    args = replica_args(options.engine_args)
    cluster: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    use_gpus = cluster.get("GPU", 0) > 0 and args.device != "cpu"
    check_pool_fits(options.replicas, args.tensor_parallel_size if use_gpus else 0, cluster)
    blocks = min(len(items), max(4 * options.replicas, math.ceil(len(items) / options.batch_size)))
    records = ray.data.from_items([item.to_record() for item in items], override_num_blocks=blocks)
    dataset = records.map_batches(
        EngineReplica,
        fn_constructor_kwargs={"engine_args": args, "output_format": options.output_format},
        batch_size=options.batch_size,
        compute=ray.data.ActorPoolStrategy(size=options.replicas),
        num_cpus=1,
        num_gpus=args.tensor_parallel_size if use_gpus else 0,
    )
    for row in dataset.iter_rows():
        yield str(row["row"])


def run_batch(options: BatchOptions) -> BatchSummary:
    """Run every row of the input not already in the output; the run's summary."""
    if options.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {options.replicas}")
    if not options.input.is_file():
        raise ValueError(f"--input {options.input} is not a file")
    done = prepare_output(options.output, options.resume)
    items, skipped = read_items(options.input, done)
    start = time.perf_counter()
    writer = OutputWriter(options.output)
    try:
        if items:
            connect_ray(options.address)
            show = sys.stderr.isatty()
            with tqdm(total=len(items), unit="row", disable=not show, file=sys.stderr) as bar:
                for row in _run_rows(options, items):
                    writer.write(row)
                    bar.update(1)
    except Exception as error:  # from Ray: the cause's last line is the readable part
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise BatchFailed(lines[-1] if lines else repr(error)) from error
    finally:
        writer.close()
    return BatchSummary(
        options.output,
        writer.ok,
        writer.errored,
        skipped,
        writer.generated_tokens,
        time.perf_counter() - start,
    )
