"""The README's speed tables, from the JSON of ``partime bench --sizes`` runs (and of
``benchmarks/torch_pipelining.py``, when given as the last file)::

    .venv/bin/python experiments/speed/tables.py experiments/speed/sweep-inference.json experiments/speed/learning.json \
        experiments/speed/torch_pipelining.json

One speed table and one latency table per mode and optimizer found in the bench's files. A
pipeline's cell gives its speed-up, then its time per sample over the bound (the slowest of the
model's own pieces of the cut, alone with plain torch) and over partime's own tick (the slowest
stage alone as partime's ``Stage`` runs it).
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

ORDER = ("sequential 1 thread", "sequential 2 threads", "replicas D=2", "process D=2", "thread D=2", "process auto")


def speed_table(rows: list[dict]) -> str:
    """Speed-up over the sequential model on one thread, per size: one column per size."""
    sizes = sorted({r["size"] for r in rows})
    by = {(r["contender"], r["size"]): r for r in rows}
    bound = {r["size"]: r for r in rows if r["kind"] == "bound" and "(" not in r["contender"]}
    head = ["", *(f"{s}x{s}: stages of {bound[s]['ms_per_sample']:.2f} ms" for s in sizes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seq = {s: by[("sequential 1 thread", s)]["ms_per_sample"] for s in sizes}
    lines.append(
        "| bound: sequential / slowest stage alone | "
        + " | ".join(f"{seq[s] / bound[s]['ms_per_sample']:.2f}" for s in sizes)
        + " |"
    )
    for name in ORDER:
        if (name, sizes[0]) not in by:
            continue
        cells = []
        for s in sizes:
            r = by[(name, s)]
            cell = f"{seq[s] / r['ms_per_sample']:.2f}"
            if r["kind"] == "pipeline" and r.get("ms_over_bound"):
                cell += f" ({r['ms_over_bound']:.2f}× bound, {r['ms_over_own_tick']:.2f}× own tick)"
            if name == "process auto":
                cell += f" D={len(r['balance'])}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_table(rows: list[dict]) -> str:
    """p50 / p99 latency in ms, per size."""
    rows = [r for r in rows if r["kind"] != "bound"]
    sizes = sorted({r["size"] for r in rows})
    by = {(r["contender"], r["size"]): r for r in rows}
    lines = [
        "| latency p50 / p99 ms | " + " | ".join(f"{s}x{s}" for s in sizes) + " |",
        "|" + "---|" * (len(sizes) + 1),
    ]
    for name in ORDER:
        if (name, sizes[0]) in by:
            cells = [f"{by[(name, s)]['latency_p50_ms']:.2f} / {by[(name, s)]['latency_p99_ms']:.2f}" for s in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def torch_table(rows: list[dict]) -> str:
    """torch.distributed.pipelining's speed-ups, per schedule and microbatch count."""
    table = defaultdict(dict)
    sizes = sorted({r["size"] for r in rows})
    for r in rows:
        if r["microbatches"] is not None:
            table[(r["mode"], r["schedule"], r["microbatches"])][r["size"]] = r["speedup_vs_seq_1thread"]
    lines = [
        "| mode | schedule | microbatches | " + " | ".join(f"{s}x{s}" for s in sizes) + " |",
        "|" + "---|" * (len(sizes) + 3),
    ]
    for (mode, schedule, m), cells in sorted(table.items()):
        lines.append(
            f"| {mode} | {schedule} | {m} | " + " | ".join(f"{cells.get(s, float('nan')):.2f}" for s in sizes) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    files = [json.loads(Path(name).read_text()) for name in sys.argv[1:]]
    torch_rows = files.pop() if files and "microbatches" in files[-1][0] else None
    for rows in files:
        runs = sorted({(r["mode"], r.get("optimizer") or "") for r in rows})
        for mode, optimizer in runs:
            mine = [r for r in rows if r["mode"] == mode and (r.get("optimizer") or "") == optimizer]
            with_ = f" with {optimizer}" if optimizer else ""
            print(f"### {mode}{with_}: speed-up over the sequential model on 1 thread\n")
            print(speed_table(mine), "\n")
            print(latency_table(mine), "\n")
    if torch_rows is not None:
        print("### torch.distributed.pipelining\n")
        print(torch_table(torch_rows))


if __name__ == "__main__":
    main()
