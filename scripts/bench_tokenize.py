"""Tokenizing speed and memory: finetune's tokenization against a plain batched ``datasets.map``, on the same rows.

    .venv/bin/python scripts/bench_tokenize.py [--rows 100000] [--procs 1,2,all] [--memory 10000,1000000]
        [--rounds 1] [--one-thread] [--out docs/bench-tokenize.md] [--workdir DIR] [--quick] [--memory-only]

Rows: generated two-turn chat rows ``{"messages": [user, assistant]}`` of random lowercase words (seed 0; user
turns 20-60 words, assistant turns 40-120, about 600 bytes a row, like the 61 MB per 100,000 rows of the issue),
written once as JSON lines and loaded once with finetune's own ``load_raw`` (an Arrow file, memory-mapped). The
tokenizer is finetune's bundled ``finetune/assets/tiny-llama-tokenizer`` (byte-level BPE, 512 tokens, its own
small chat template): with so few merges a row has about 3 tokens per word, so tokenizing weighs more here than
with a real vocabulary, and the chat template (one line) less than a real one.

Passes, each in a fresh child process (so each has its own peak RSS) on the same Arrow rows, with the cache
emptied before it (every pass tokenizes; none is served from an earlier pass's cache):

* ``baseline``: ``Dataset.map(batched=True)`` (1,000 rows a batch, one process) of ``render + tokenize``: each
  row's messages through ``tokenizer.apply_chat_template(messages, tokenize=False)``, the batch's texts through
  ``tokenizer(texts)``. No checks, no masking, no generation prompt.
* ``finetune num_proc=N``: ``finetune.data.tokenize.tokenize_rows`` as ``finetune run`` calls it (format chat,
  max_seq_len 4096 so nothing is cut): every row checked, rendered with its answer spans, tokenized with offsets,
  labels masked, the generation prompt tokenized, over-long and no-answer rows counted. ``all`` is the cores the
  process may use.
* ``cache hit``: ``tokenize_rows`` again after the last finetune pass, in a fresh process (what ``finetune run``
  does when the data was tokenized before).

``--one-thread``: every pass with ``TOKENIZERS_PARALLELISM=false``, so each process tokenizes on one thread. By
default a fast tokenizer's batch call spreads over every core in its own threads (``num_proc=1`` already uses
them for the Rust part of the work), while ``datasets``' forked workers each get one thread (the tokenizers
library turns its threads off in a process forked after it used them): with this flag ``num_proc`` is the only
parallelism, which shows how the passes scale with processes.

``rows/s`` is rows over the wall time of the ``map`` (or ``tokenize_rows``) call alone; ``vs baseline`` is the
ratio to the baseline's rows/s in the same run. ``--rounds N`` runs every pass N times (every other round in
reverse order) and reports each pass's fastest round. ``CPU s`` is the CPU time the pass used (its threads and worker
processes), and ``cores`` that CPU time over the wall time (how many cores the pass kept busy): on a machine
other work shares, rows per CPU second compares the work each pass does, which wall time
on a busy machine does not. ``peak RSS`` is the child's own ``ru_maxrss``; ``workers`` adds
the largest of its worker processes (num_proc > 1). The machine may be shared: the report gives the load
average, and only ratios within one run compare.

``--memory A,B``: for each count, the rows are converted to Arrow once (untimed), tokenized from an empty cache
(finetune, default ``num_proc``), then read from the cache in a fresh process (the cache hit: ``load_raw`` +
``tokenize_rows``, what ``finetune run`` does on a second start). Each in its own process: peak RSS, the peak of
the tokenizing phase as VmRSS and RssAnon (sampled from ``/proc/<pid>/status`` every 0.2 s; RssAnon leaves out the
pages of memory-mapped Arrow files and shared libraries, which the kernel can drop and re-read), the largest
worker's peak (``ru_maxrss`` of the children, and its sampled RssAnon), and the cache hit's time. The
growth of B's peak over A's is compared with the bound finetune states (the tokenized rows live in Arrow files,
memory-mapped; no Python list holds every row). ``load`` is the 1-minute load average at each pass's start and end.
``--quick``: 2,000 rows, for developing the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "finetune" / "assets" / "tiny-llama-tokenizer"
MEMORY_BOUND_MIB = 512  # the stated bound: 1M rows peak at most this much above 10k rows


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` two-turn chat rows of random words, as JSON lines."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[:12 if i % 3 else 26]) for _ in range(rng.randint(2, 8)))
             for i in range(5000)]
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(rows):
            user = " ".join(rng.choices(words, k=rng.randint(20, 60))).capitalize() + "?"
            answer = " ".join(rng.choices(words, k=rng.randint(40, 120))).capitalize() + "."
            handle.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": answer}]}) + "\n")


def _cpu() -> float:
    """CPU seconds of this process (all its threads: the tokenizer's Rust threads too) and its ended children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _peaks() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rss_mib": round(own, 1), "workers_mib": round(children, 1)}


class Sampler:
    """This process's resident memory every ``every_s`` seconds (``/proc/self/status``), the peak of each phase:
    ``VmRSS`` (what ``ru_maxrss`` peaks) and ``RssAnon``, the part that is not file pages (a memory-mapped Arrow
    file's pages count in VmRSS while they are read, and are dropped first when memory is short)."""

    def __init__(self, every_s: float = 0.2) -> None:
        import threading

        self.phase, self.peaks = "start", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    @staticmethod
    def _status(pid: str) -> tuple[float, float]:
        """(VmRSS, RssAnon) of a process in MiB; zeros where it is gone or there is no /proc (not Linux)."""
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon"))  # type: ignore
        except (OSError, KeyError, ValueError):
            return 0.0, 0.0

    def _read(self) -> None:
        children = []  # the worker processes (num_proc > 1): the largest of them is the "workers" peak
        for task in Path("/proc/self/task").glob("*/children"):
            with contextlib.suppress(OSError):
                children += task.read_text().split()
        for key, (rss, anon) in [(self.phase, self._status("self")),
                                 ("workers", max(map(self._status, children), default=(0.0, 0.0)))]:
            old = self.peaks.get(key, (0.0, 0.0))
            self.peaks[key] = (max(old[0], rss), max(old[1], anon))

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._read()

    def enter(self, phase: str) -> None:
        self._read()
        self.phase = phase
        self._read()

    def stop(self) -> dict[str, list[float]]:
        self._read()
        self._stop.set()
        return {phase: [round(rss, 1), round(anon, 1)] for phase, (rss, anon) in self.peaks.items()}


def run_pass(kind: str, data: str, procs: int) -> dict:
    """One pass in this (child) process; returns rows, seconds, CPU, peak RSS (``ru_maxrss``, and per phase from
    :class:`Sampler`) and the load average at its start and end. ``load``: load the raw rows only (the first load
    of a file converts it to Arrow); ``finetune`` times ``load_raw`` (``load_s``) and ``tokenize_rows``."""
    sampler = Sampler()
    load_start = os.getloadavg()[0]
    import datasets
    from transformers import AutoTokenizer

    from finetune.data.loading import load_raw
    from finetune.data.tokenize import tokenize_rows

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    sampler.enter("load")
    start = time.perf_counter()
    raw = load_raw(data)
    load_s = time.perf_counter() - start
    sampler.enter("tokenize")
    start, cpu = time.perf_counter(), _cpu()
    cached = None  # finetune: whether tokenize_rows was served from the cache
    if kind == "baseline":
        def render_and_tokenize(batch: dict) -> dict:
            texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages in batch["messages"]]
            return tokenizer(texts)

        raw.map(render_and_tokenize, batched=True, batch_size=1000, remove_columns=raw.column_names)
    elif kind == "finetune":
        cached = tokenize_rows(raw, fmt="chat", tokenizer=tokenizer, max_len=4096, overlong="truncate",
                               add_bos="auto", source=data,
                               num_proc=procs or None).cached  # 0: the default
    seconds = time.perf_counter() - start
    return {"rows": len(raw), "seconds": seconds, "cpu": _cpu() - cpu, "load_s": load_s, "cached": cached, **_peaks(),
            "phases": sampler.stop(), "load": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def child(kind: str, data: str, procs: int, cache: Path, keep_cache: bool = False, one_thread: bool = False
          ) -> dict:
    """:func:`run_pass` in a fresh process; the tokenized-data cache is emptied first unless ``keep_cache``;
    ``one_thread``: the tokenizer's own threads off (``TOKENIZERS_PARALLELISM=false``)."""
    if not keep_cache:
        for stale in cache.rglob("cache-*.arrow"):
            stale.unlink()
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    if one_thread:
        env["TOKENIZERS_PARALLELISM"] = "false"
    out = subprocess.run([sys.executable, __file__, "--child", kind, data, str(procs)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load(r: dict) -> str:
    """The 1-minute load average at a pass's start and end."""
    return f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"


def memory_report(counts: list[int], work: Path, cache: Path) -> list[str]:
    """For each row count: the rows converted to Arrow (the first load of the file, untimed here), tokenized from
    an empty cache (finetune, default ``num_proc``), then read again from the cache in a fresh process (the cache
    hit ``finetune run`` makes: ``load_raw`` + ``tokenize_rows``). Each in its own process: peak RSS (``ru_maxrss``),
    the peak of its tokenizing phase, RssAnon (RSS less file pages) and its workers' peak. Then the growth of the
    largest count's tokenizing peak over the smallest's, against :data:`MEMORY_BOUND_MIB`."""
    out = ["", "| memory: rows | tokenize s | rows/s | peak RSS MiB | tokenize-phase RSS / RssAnon MiB "
           "| workers' peak RSS / RssAnon MiB | cache hit s (load + tokenize_rows) "
           "| cache-hit peak RSS / RssAnon MiB | load |",
           "|---|---|---|---|---|---|---|---|---|"]
    measured = []
    for count in counts:
        path = work / f"chat-{count}.jsonl"
        if not path.exists():
            write_rows(path, count)
        child("load", str(path), 0, cache, keep_cache=True)  # JSON lines -> Arrow, once per file
        cold = child("finetune", str(path), 0, cache)
        hit = child("finetune", str(path), 0, cache, keep_cache=True)
        measured.append((cold, hit))
        tok, workers = cold["phases"].get("tokenize", [0, 0]), cold["phases"].get("workers", [0, 0])
        out.append(f"| {count:,} | {cold['seconds']:.1f} | {count / cold['seconds']:,.0f} | {cold['rss_mib']:,.0f} | "
                   f"{tok[0]:,.0f} / {tok[1]:,.0f} | {cold['workers_mib']:,.0f} / {workers[1]:,.0f} | "
                   f"{hit['load_s'] + hit['seconds']:.1f} ({hit['load_s']:.1f} + {hit['seconds']:.1f}"
                   f"{'' if hit['cached'] else ', NOT served from the cache'}) | "
                   f"{hit['rss_mib']:,.0f} / {max(p[1] for k, p in hit['phases'].items() if k != 'workers'):,.0f} | "
                   f"{_load(cold)}, {_load(hit)} |")
    (small, _), (big, _) = measured[0], measured[-1]
    grow = big["rss_mib"] - small["rss_mib"]
    grow_workers = big["workers_mib"] - small["workers_mib"]
    out.append(f"\n{counts[-1]:,} rows peak {grow:+,.0f} MiB over {counts[0]:,} rows (workers "
               f"{grow_workers:+,.0f} MiB; stated bound: +{MEMORY_BOUND_MIB} MiB): "
               f"{'within' if max(grow, grow_workers) <= MEMORY_BOUND_MIB else 'OVER'} the bound")
    return out


def versions() -> str:
    import datasets
    import tokenizers
    import transformers

    return (f"python {platform.python_version()}, datasets {datasets.__version__}, transformers "
            f"{transformers.__version__}, tokenizers {tokenizers.__version__}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--procs", default="1,2,all", help="num_proc values of the finetune passes")
    parser.add_argument("--memory", default="", help="A,B: peak RSS tokenizing A rows and B rows (e.g. 10000,1000000)")
    parser.add_argument("--out", default="docs/bench-tokenize.md")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--rounds", type=int, default=1, help="run every pass this many times; report the fastest")
    parser.add_argument("--quick", action="store_true", help="2,000 rows (for developing the script)")
    parser.add_argument("--one-thread", action="store_true", help="every process tokenizes on one thread")
    parser.add_argument("--memory-only", action="store_true", help="only the --memory passes")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, data, procs = args.child
        print(json.dumps(run_pass(kind, data, int(procs))))
        return 0
    rows = 2000 if args.quick else args.rows
    cores = len(os.sched_getaffinity(0))
    procs = list(dict.fromkeys(cores if p == "all" else int(p) for p in args.procs.split(",")))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "datasets-cache"
    data = work / f"chat-{rows}.jsonl"
    if not data.exists() and not args.memory_only:
        write_rows(data, rows)
    lines = []
    load_start = "/".join(f"{x:.2f}" for x in os.getloadavg())
    if not args.memory_only:
        passes = [("baseline: datasets.map(batched=True), render + tokenize", "baseline", 1)]
        passes += [(f"finetune num_proc={n}" + (" (all cores)" if n == cores else ""), "finetune", n) for n in procs]
        best: dict[str, dict] = {}
        for round_ in range(args.rounds):  # every other round in reverse order: a slow spell hits different passes
            for name, kind, n in passes if round_ % 2 == 0 else passes[::-1]:
                got = child(kind, str(data), n, cache, one_thread=args.one_thread)
                if name not in best or got["seconds"] < best[name]["seconds"]:
                    best[name] = got
        results = [(name, best[name]) for name, _, _ in passes]
        if args.rounds > 1:  # the last pass run (the baseline) emptied the cache: fill it again, untimed
            child("finetune", str(data), procs[-1], cache, one_thread=args.one_thread)
        results.append((f"finetune cache hit (num_proc={procs[-1]})",
                        child("finetune", str(data), procs[-1], cache, keep_cache=True, one_thread=args.one_thread)))
        base = results[0][1]["rows"] / results[0][1]["seconds"]
        base_cpu = results[0][1]["rows"] / results[0][1]["cpu"]
        lines += ["| pass | rows | seconds | rows/s | vs baseline | CPU s | cores | rows per CPU s | vs baseline "
                  "| peak RSS MiB | workers' peak RSS MiB | load |", "|---" * 12 + "|"]
        for name, r in results:
            rate, per_cpu = r["rows"] / r["seconds"], r["rows"] / max(r["cpu"], 1e-9)
            busy = r["cpu"] / max(r["seconds"], 1e-9)  # cores kept busy
            lines.append(f"| {name} | {r['rows']:,} | {r['seconds']:.1f} | {rate:,.0f} | {rate / base:.2f}x | "
                         f"{r['cpu']:.1f} | {busy:.2f} | {per_cpu:,.0f} | {per_cpu / base_cpu:.2f}x | "
                         f"{r['rss_mib']:,.0f} | {r['workers_mib']:,.0f} | {_load(r)} |")
    if args.memory:
        lines += memory_report([int(x) for x in args.memory.split(",")], work, cache)
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["scripts/bench_tokenize.py", *sys.argv[1:]])
    counted, largest = (args.memory, work / f"chat-{args.memory.split(',')[-1]}.jsonl") if args.memory_only \
        else (f"{rows:,}", data)
    report = [
        "# Tokenizing: finetune vs a plain batched datasets.map", "",
        f"- command: `.venv/bin/python {command}`",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {platform.processor() or platform.machine()}; {os.cpu_count()} cores ({cores} usable); "
        f"load average (1/5/15 min) {load_start} at the start, {load} at the end (the machine may be shared: compare "
        "ratios within this run only)",
        f"- versions: {versions()}",
        f"- tokenizer threads: {'one per process (--one-thread)' if args.one_thread else 'the tokenizers default'}",
        f"- rows: {counted} generated two-turn chat rows ({largest.stat().st_size / 2**20:.0f} MiB of JSON lines"
        f"{' for the largest count' if args.memory_only else ''}); tokenizer: "
        "finetune/assets/tiny-llama-tokenizer (its own chat template)", "",
        *lines, "",
        "See the docstring of scripts/bench_tokenize.py for what each pass does and measures.", ""]
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
