"""What a soak run must show, checked on its record, and the table it prints.

Each check returns a `Check`: a name, whether it held, and a line of figures. The
driver (run.py) gathers the record (outcomes, faults, process samples, engine stats,
metric deltas); nothing here talks to the cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from benchmarks.soak.faults import Injected
from benchmarks.soak.processes import ProcessRecord
from benchmarks.soak.traffic import (
    CLIENT_CANCELLED,
    CLIENT_TIMEOUT,
    CONNECTION_LOST,
    Outcome,
)

# Ends a request may have whatever happened: its own (client) ends, and the retryable
# errors the faults cause. UNAVAILABLE and CONNECTION_LOST must also fall near a fault.
RETRYABLE = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}
FAULT_CODES = {"UNAVAILABLE", CONNECTION_LOST}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def no_hang(outcomes: list[Outcome], slack_s: float) -> Check:
    hung = [o for o in outcomes if o.code == CLIENT_TIMEOUT]
    late = [o for o in outcomes if o.spec.deadline_s is not None
            and o.elapsed > o.spec.deadline_s + slack_s]
    worst = max((o.elapsed for o in outcomes), default=0.0)
    return Check("every request ended (no hang)", not hung and not late,
                 f"{len(hung)} hit the client's guard, {len(late)} ended past deadline + "
                 f"{slack_s:g} s; longest {worst:.1f} s"
                 + _examples(hung + late))


def codes_allowed(outcomes: list[Outcome], faults: list[Injected], window_s: float) -> Check:
    bad: list[Outcome] = []
    for o in outcomes:
        if o.spec.invalid:
            ok = o.code == "INVALID_ARGUMENT" or (o.code in FAULT_CODES
                                                  and near_fault(o, faults, window_s))
        elif o.code in ("OK", CLIENT_CANCELLED):
            ok = True
        elif o.code in FAULT_CODES:
            ok = near_fault(o, faults, window_s) and bool(o.message)
        else:
            ok = o.code in RETRYABLE and bool(o.message)
        if not ok:
            bad.append(o)
    return Check("each ended complete or with a documented retryable error", not bad,
                 f"{len(bad)} did not (UNAVAILABLE / connection lost count only within "
                 f"{window_s:g} s of a fault)" + _examples(bad))


def near_fault(o: Outcome, faults: Iterable[Injected], window_s: float) -> bool:
    return any(o.started <= f.ended + window_s and o.ended >= f.started - 1.0
               for f in faults)


def retry_hints(outcomes: list[Outcome]) -> Check:
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    missing = [o for o in refused if not o.retry_hint]
    return Check("overload refusals carry a retry hint", not missing,
                 f"{len(refused)} refused, {len(missing)} without retry-after"
                 + _examples(missing))


def texts_match(outcomes: list[Outcome], references: Mapping[tuple, str | None]) -> Check:
    compared = 0
    wrong: list[Outcome] = []
    for o in outcomes:
        key = o.spec.reference_key
        if o.code != "OK" or key is None:
            continue
        reference = references.get(key)
        if reference is None:
            continue
        compared += len(o.texts)
        if any(text != reference for text in o.texts):
            wrong.append(o)
    missing = sum(1 for k, v in references.items() if v is None)
    return Check("greedy texts equal the reference answer", not wrong and not missing,
                 f"{compared} samples compared over {len(references)} prompts, "
                 f"{len(wrong)} requests differ, {missing} references failed"
                 + _examples(wrong, lambda o: f"{o.texts!r} vs "
                             f"{references.get(o.spec.reference_key)!r}"))


def engines_drained(stats: list[Mapping[str, object]]) -> Check:
    bad = [s for s in stats if s.get("num_free_blocks") != s.get("num_blocks")
           or s.get("num_running") or s.get("num_waiting") or s.get("state") != "RUNNING"]
    detail = "; ".join(
        f"engine {s.get('engine_index')}: {s.get('num_free_blocks')}/{s.get('num_blocks')} "
        f"blocks free, {s.get('num_running')} running, {s.get('num_waiting')} waiting, "
        f"{s.get('state')}" for s in stats)
    return Check("KV blocks all free, no request left in any engine",
                 bool(stats) and not bad, detail or "no engine answered")


def frontend_drained(in_flight: float | None) -> Check:
    return Check("no request left in the frontend", in_flight == 0,
                 f"{in_flight} requests in flight per the frontend's metrics")


def resources_flat(records: list[ProcessRecord], rss_drift: float, min_lived_s: float,
                   fd_slack: int, thread_slack: int) -> Check:
    judged = [r for r in records if r.lived_s >= min_lived_s]
    bad = [r for r in judged
           if r.last.rss_bytes > r.warm.rss_bytes * (1 + rss_drift)
           or r.last.fds > r.warm.fds + fd_slack
           or r.last.threads > r.warm.threads + thread_slack]
    lines = [f"{r.role} (pid {r.pid}, {r.lived_s:.0f} s{', ended' if r.ended else ''}): RSS "
             f"{r.warm.rss_bytes / 2**20:.0f} -> {r.last.rss_bytes / 2**20:.0f} MiB "
             f"({(r.last.rss_bytes / r.warm.rss_bytes - 1) * 100:+.1f}%), fds "
             f"{r.warm.fds} -> {r.last.fds}, threads {r.warm.threads} -> {r.last.threads}"
             for r in records]
    return Check(f"RSS within {rss_drift:.0%} of warm, descriptors and threads flat",
                 not bad, f"{len(judged)} processes judged (lived >= {min_lived_s:g} s)\n"
                 + "\n".join(f"    {line}" for line in lines))


def metrics_agree(expected: Mapping[str, float], measured: Mapping[str, float]) -> Check:
    keys = sorted(set(expected) | set(measured))
    bad = [k for k in keys if expected.get(k, 0) != measured.get(k, 0)]
    detail = ", ".join(f"{k}: client {expected.get(k, 0):g} / metrics {measured.get(k, 0):g}"
                       for k in keys)
    return Check("the frontend's metrics agree with the client's counts", not bad, detail)


def faults_healed(faults: list[Injected], heal_s: Mapping[int, float | None]) -> Check:
    lines = []
    bad = []
    for i, f in enumerate(faults):
        healed = heal_s.get(i)
        if f.error:
            lines.append(f"{f.fault.kind} at {f.fault.at_s:.0f} s: skipped ({f.error})")
            continue
        lines.append(f"{f.fault.kind} at {f.fault.at_s:.0f} s on {f.target}: "
                     + (f"serving again after {healed:.1f} s" if healed is not None
                        else "never healed"))
        if healed is None:
            bad.append(f)
    return Check("the cluster healed after every fault", not bad,
                 "\n".join(f"    {line}" for line in lines))


def every_kind(faults: list[Injected], kinds: Iterable[str]) -> Check:
    done = Counter(f.fault.kind for f in faults if not f.error)
    missing = [k for k in kinds if not done[k]]
    return Check("every fault kind injected", not missing,
                 ", ".join(f"{k} x{done[k]}" for k in kinds)
                 + (f"; missing {missing}" if missing else ""))


def codes_table(outcomes: list[Outcome]) -> str:
    by_door: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_door.setdefault(o.spec.door, Counter())[o.code] += 1
    codes = sorted({c for counts in by_door.values() for c in counts})
    width = max((len(d) for d in by_door), default=4)
    head = f"{'door':<{width}} " + " ".join(f"{c:>18}" for c in codes) + f" {'total':>7}"
    rows = [head]
    for door in sorted(by_door):
        counts = by_door[door]
        rows.append(f"{door:<{width}} " + " ".join(f"{counts[c]:>18}" for c in codes)
                    + f" {sum(counts.values()):>7}")
    return "\n".join(rows)


def _examples(outcomes: list[Outcome], show: object = None, limit: int = 3) -> str:
    if not outcomes:
        return ""
    lines = []
    for o in outcomes[:limit]:
        extra = show(o) if callable(show) else o.message[:200]
        lines.append(f"    #{o.spec.index} {o.spec.door} {o.code} after {o.elapsed:.2f} s: "
                     f"{extra}")
    return "\n" + "\n".join(lines)
