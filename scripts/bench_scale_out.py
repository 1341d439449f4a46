"""Scale-out measurements on this machine: replicas pinned to their own cores behind `llmopt route`.

    python scripts/bench_scale_out.py ARTIFACT cache    [--rounds 3] [--kv-cache-memory 115MiB] [--out DIR]
    python scripts/bench_scale_out.py ARTIFACT kill     [--out DIR]
    python scripts/bench_scale_out.py ARTIFACT tenants  [--rounds 5] [--out DIR]
    python scripts/bench_scale_out.py ARTIFACT overhead [--rounds 5] [--out DIR]

Every replica is an `llmopt serve ARTIFACT --threads 1 --max-model-len 1024 --max-num-seqs 4` pinned to one core
(`taskset`), started afresh for each run; the load is `llmopt bench` (or, for `kill` and `tenants`, a streaming
client here that records each request's outcome). Rounds interleave the compared setups; tables give medians.

- cache: two replicas; `--dataset shared-prefix:8,512` (128 prompts, 32-token questions, 16 output tokens,
  concurrency 8) through round-robin and cache-aware, with the prefix-cache hit rate summed from the replicas'
  own /metrics; then `--dataset random` (32 tokens) through least-load and cache-aware: output throughput.
- kill: two replicas, cache-aware, a streaming load at concurrency 12; SIGKILL of replica 1 mid-load, the time
  until the router's `llmopt_router:replica_healthy` shows it out, its restart, the time from its first healthy
  /health until the router takes it back; then both stopped: the router's answer. Every request's outcome.
- tenants: one replica (core 0), clients on core 1; tenant B's p50 TTFT alone, then while tenant A floods at
  ten times its tokens_per_minute (from 15 s before B's run, so A's first full bucket is spent); A's 429s and
  their Retry-After.
- overhead: one replica and the client on core 0, the router alone on core 1; single-stream ShareGPT straight
  to the replica and through the router, interleaved: median TTFT and ITL.

Writes DIR/*.json (each run's reports) and DIR/<mode>.md (the table), and prints the table.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

LLMOPT = [sys.executable, "-m", "llmopt.cli.main"]
REPLICA_ARGS = ["--threads", "1", "--max-model-len", "1024", "--max-num-seqs", "4"]
ROUTER_PORT, FIRST_PORT = 8100, 8101


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> float:
    """Seconds until `url`/health answers 200 (the process must stay alive meanwhile)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):  # not listening yet: ask again
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.05)
    raise SystemExit(f"{url}: not healthy after {timeout:.0f} s")


def start_replica(artifact: str, port: int, core: int, out: Path, extra: list[str] = ()) -> subprocess.Popen:
    log = open(out / f"replica-{port}.log", "ab")
    return subprocess.Popen(["taskset", "-c", str(core), *LLMOPT, "serve", artifact, "--port", str(port),
                             *REPLICA_ARGS, *extra], stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def replicas(artifact: str, n: int, out: Path, extra: list[str] = ()):
    procs = [start_replica(artifact, FIRST_PORT + i, i % os.cpu_count(), out, extra) for i in range(n)]
    try:
        for i, proc in enumerate(procs):
            _wait_healthy(f"http://127.0.0.1:{FIRST_PORT + i}", proc)
        yield procs
    finally:
        for proc in procs:
            stop(proc)


@contextmanager
def router(ports: list[int], policy: str, out: Path, extra: list[str] = (), core: int | None = None):
    pin = ["taskset", "-c", str(core)] if core is not None else []
    command = [*pin, *LLMOPT, "route", "--policy", policy, "--port", str(ROUTER_PORT), *extra]
    for port in ports:
        command += ["--replica", f"http://127.0.0.1:{port}"]
    proc = subprocess.Popen(command, stdout=open(out / "router.log", "ab"), stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{ROUTER_PORT}", proc)
        yield proc
    finally:
        stop(proc)


def bench(url: str, options: list[str], path: Path, core: int | None = None) -> dict:
    pin = ["taskset", "-c", str(core)] if core is not None else []
    result = subprocess.run([*pin, *LLMOPT, "bench", "--url", url, *options, "--quiet", "--json", str(path)],
                            stdout=subprocess.DEVNULL)
    if result.returncode != 0:
        raise SystemExit(f"llmopt bench {' '.join(options)} failed with exit code {result.returncode}")
    return json.loads(path.read_text())


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped) from a Prometheus text page."""
    sums: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def med(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------- cache
SHARED = ["--dataset", "shared-prefix:8,512", "--num-prompts", "128", "--input-len", "32", "--output-len", "16",
          "--ignore-eos", "--max-concurrency", "8", "--warmup", "0", "--seed", "0"]
RANDOM = ["--dataset", "random", "--num-prompts", "128", "--input-len", "32", "--output-len", "16",
          "--ignore-eos", "--max-concurrency", "8", "--warmup", "0", "--seed", "0"]


def cache_run(args, policy: str, load: list[str], name: str, round_: int) -> dict:
    extra = ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
    with replicas(args.artifact, 2, args.out, extra):
        with router([FIRST_PORT, FIRST_PORT + 1], policy, args.out, args.route_args):
            report = bench(f"http://127.0.0.1:{ROUTER_PORT}", load, args.out / f"cache-{name}-{policy}-{round_}.json")
            hits = queries = 0.0
            for port in (FIRST_PORT, FIRST_PORT + 1):
                m = scrape(f"http://127.0.0.1:{port}")
                hits += m.get("llmopt:prefix_cache_hits_total", 0.0)
                queries += m.get("llmopt:prefix_cache_queries_total", 0.0)
            decisions = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in
                         httpx.get(f"http://127.0.0.1:{ROUTER_PORT}/metrics", timeout=10).text.splitlines()
                         if line.startswith("llmopt_router:routing_decisions_total{")}
    row = {"policy": policy, "workload": name, "round": round_, "hit_rate": hits / queries if queries else 0.0,
           "median_ttft_ms": report["median_ttft_ms"], "output_throughput": report["output_throughput"],
           "completed": report["completed"], "decisions": decisions}
    print(f"round {round_} {name:13} {policy:11}: hit rate {row['hit_rate']:.3f}, median TTFT "
          f"{row['median_ttft_ms']:.1f} ms, output {row['output_throughput']:.1f} tok/s", file=sys.stderr, flush=True)
    return row


def cache(args) -> str:
    rows = []
    for round_ in range(1, args.rounds + 1):
        for policy in ("round-robin", "cache-aware"):
            rows.append(cache_run(args, policy, SHARED, "shared-prefix", round_))
        for policy in ("least-load", "cache-aware"):
            rows.append(cache_run(args, policy, RANDOM, "random", round_))
    (args.out / "cache.json").write_text(json.dumps(rows, indent=1))

    def pick(workload, policy, key):
        return [r[key] for r in rows if r["workload"] == workload and r["policy"] == policy]

    lines = [f"Two replicas, one core each, `--kv-cache-memory {args.kv_cache_memory or 'default'}`; medians of "
             f"{args.rounds} rounds.", "",
             "| workload | policy | prefix-cache hit rate | median TTFT ms | output tok/s | per round (hit rate / TTFT / tok/s) |",
             "|---|---|---|---|---|---|"]
    for workload, policies in (("shared-prefix", ("round-robin", "cache-aware")), ("random", ("least-load", "cache-aware"))):
        for policy in policies:
            per = "; ".join(f"{h:.3f} / {t:.0f} / {o:.1f}" for h, t, o in zip(
                pick(workload, policy, "hit_rate"), pick(workload, policy, "median_ttft_ms"),
                pick(workload, policy, "output_throughput")))
            lines.append(f"| {workload} | {policy} | {med(pick(workload, policy, 'hit_rate')):.3f} | "
                         f"{med(pick(workload, policy, 'median_ttft_ms')):.1f} | "
                         f"{med(pick(workload, policy, 'output_throughput')):.1f} | {per} |")
    hit = [a / b for a, b in zip(pick("shared-prefix", "cache-aware", "hit_rate"),
                                 pick("shared-prefix", "round-robin", "hit_rate"))]
    ttft = [a / b for a, b in zip(pick("shared-prefix", "cache-aware", "median_ttft_ms"),
                                  pick("shared-prefix", "round-robin", "median_ttft_ms"))]
    tput = [a / b for a, b in zip(pick("random", "cache-aware", "output_throughput"),
                                  pick("random", "least-load", "output_throughput"))]
    lines += ["", f"cache-aware / round-robin hit rate: {med(hit):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in hit)}); "
              f"median TTFT {med(ttft):.2f}x ({', '.join(f'{x:.2f}' for x in ttft)}); "
              f"random cache-aware / least-load output tok/s: {med(tput):.3f}x ({', '.join(f'{x:.3f}' for x in tput)})"]
    return "\n".join(lines)


# ---------------------------------------------------------------- streaming client (kill, tenants)
async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, key: str | None = None) -> dict:
    """One streaming completion: its status, when its first token came, how it ended."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    start = time.monotonic()
    rec = {"start": start, "status": None, "first_token": None, "tokens": 0, "error_frame": False, "done": False,
           "finish_reason": None, "retry_after": None, "cut": False}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
            rec["status"] = response.status_code
            rec["retry_after"] = response.headers.get("retry-after")
            if response.status_code != 200:
                await response.aread()
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    rec["error_frame"] = True
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    rec["tokens"] += 1
                    rec["first_token"] = rec["first_token"] or time.monotonic()
                rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
    except httpx.HTTPError:
        rec["cut"] = True
    rec["end"] = time.monotonic()
    return rec


PROMPTS = [f"Question {i}: in two sentences, why does the sky look blue at noon and red at sunset?" for i in range(64)]
LONG = " ".join(["Background: sunlight holds every colour; air molecules scatter short wavelengths far more than long"
                 " ones, and at sunset the light crosses much more air before it reaches the eye."] * 5)
B_PROMPTS = [" ".join(random.Random(i).sample(LONG.split(), len(LONG.split()))) + f"\nQuestion {i}: why is the sky blue?"
             for i in range(64)]  # ~200 tokens each, shuffled so that no two share a cached prefix


async def _healthy_series(url: str, until: asyncio.Event, samples: list) -> None:
    """(time, {replica: healthy}) from the router's own metrics every 50 ms."""
    async with httpx.AsyncClient(timeout=2) as client:
        while not until.is_set():
            with contextlib.suppress(httpx.HTTPError):  # a sample lost to a busy router is only a gap
                text = (await client.get(url + "/metrics")).text
                state = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) == 1.0
                         for line in text.splitlines() if line.startswith("llmopt_router:replica_healthy{")}
                samples.append((time.monotonic(), state))
            await asyncio.sleep(0.05)


def _first(samples: list, after: float, replica: str, healthy: bool) -> float | None:
    return next((t for t, s in samples if t >= after and s.get(replica) is healthy), None)


KILL_CONCURRENCY = 12  # more than the two replicas' 4 + 4 slots: some wait on the victim when it dies


async def _kill(args) -> str:
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    victim_url = f"http://127.0.0.1:{FIRST_PORT + 1}"
    with replicas(args.artifact, 2, args.out) as procs, router([FIRST_PORT, FIRST_PORT + 1], "cache-aware", args.out,
                                                              args.route_args):
        samples, stop_sampling = [], asyncio.Event()
        sampler = asyncio.create_task(_healthy_series(url, stop_sampling, samples))
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(args.kill_requests):
            queue.put_nowait(PROMPTS[i % len(PROMPTS)])
        records = []

        async def worker(client):
            while not queue.empty():
                records.append(await stream_one(client, url, queue.get_nowait(), 48))

        async with httpx.AsyncClient(timeout=120) as client:
            workers = [asyncio.create_task(worker(client)) for _ in range(KILL_CONCURRENCY)]
            await asyncio.sleep(args.kill_after)
            killed = time.monotonic()
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            await asyncio.gather(*workers)
            retries = sum(float(line.rsplit(" ", 1)[1]) for line in (await client.get(url + "/metrics")).text.splitlines()
                          if line.startswith("llmopt_router:retries_total{"))
            ejected = _first(samples, killed, victim_url, False)
            # back: the same replica restarted on its port; its first healthy /health, then the router's readmission
            procs[1] = start_replica(args.artifact, FIRST_PORT + 1, 1, args.out)
            await asyncio.to_thread(_wait_healthy, victim_url, procs[1])
            back = time.monotonic()
            await asyncio.sleep(4)
            readmitted = _first(samples, back - 0.2, victim_url, True)
            # none healthy: both stopped
            for proc in procs:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            await asyncio.sleep(args.eject_wait)
            none = await client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        stop_sampling.set()
        await sampler
    (args.out / "kill.json").write_text(json.dumps({"killed": killed, "records": records}, indent=1))
    statuses = sorted({r["status"] for r in records})
    complete = [r for r in records if r["done"] and not r["error_frame"] and r["finish_reason"] == "length"]
    broken = [r for r in records if r["error_frame"]]
    started_before = {id(r) for r in records if r["first_token"] is not None and r["first_token"] < killed}
    after = [r for r in records if r["first_token"] is None or r["first_token"] >= killed]
    unstarted_failed = [r for r in records if not r["done"] or (r["error_frame"] and id(r) not in started_before)]
    lines = [f"Two replicas (one core each) behind `llmopt route --policy cache-aware {' '.join(args.route_args)}`; "
             f"{args.kill_requests} streaming completions (48 tokens) at concurrency {KILL_CONCURRENCY}; replica 2 SIGKILLed "
             f"{args.kill_after:.0f} s in.", "",
             "| | |", "|---|---|",
             f"| requests | {len(records)} |",
             f"| completed (48 tokens, finish_reason length, [DONE]) | {len(complete)} |",
             f"| mid-stream when killed: error frame then [DONE] | {len(broken)} (all started before the kill: "
             f"{all(id(r) in started_before for r in broken)}) |",
             f"| retried on the other replica before their first byte (the router's retries_total) | {retries:.0f} |",
             f"| first token after the kill, all completed | {len(after)} ({all(r in complete for r in after)}) |",
             f"| failed without an error frame, or cut connections | {len(unstarted_failed)} |",
             f"| HTTP statuses the router returned under load | {', '.join(map(str, statuses))} |",
             f"| ejected after the kill | {ejected - killed:.2f} s |" if ejected else "| ejected | never |",
             f"| re-admitted after its /health passed again | {readmitted - back:.2f} s |" if readmitted
             else "| re-admitted | never |",
             f"| both replicas down: the router's answer | {none.status_code}, Retry-After: "
             f"{none.headers.get('retry-after')} |"]
    return "\n".join(lines)


def kill(args) -> str:
    return asyncio.run(_kill(args))


# ---------------------------------------------------------------- tenants
async def _tenant_load(url: str, key: str, n: int, concurrency: int, max_tokens: int) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(B_PROMPTS[i % len(B_PROMPTS)])
    records = []

    async def worker(client):
        while not queue.empty():
            records.append(await stream_one(client, url, queue.get_nowait(), max_tokens, key))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return records


async def _flood(url: str, key: str, rate: float, until: asyncio.Event, records: list) -> None:
    """Requests from tenant A at `rate` per second, each on its own, until told to stop."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        tasks = []
        while not until.is_set():
            tasks.append(asyncio.create_task(stream_one(client, url, PROMPTS[len(tasks) % len(PROMPTS)], 16, key)))
            await asyncio.sleep(1 / rate)
        records.extend(await asyncio.gather(*tasks))


def _ttft(records: list[dict]) -> float:
    return med([(r["first_token"] - r["start"]) * 1000 for r in records if r["first_token"]])


async def _tenants(args) -> str:
    keys = args.out / "tenants.yaml"
    # A: 600 tokens a minute (prompt + max_tokens reserved per request: about 20 + 16), one at a time at most
    keys.write_text("keys:\n  - key: key-a\n    name: flooder\n    tokens_per_minute: 600\n    max_concurrency: 1\n"
                    "  - key: key-b\n    name: steady\n  - key: key-c\n    name: unlimited\n")
    url = f"http://127.0.0.1:{FIRST_PORT}"
    b_requests, b_concurrency = 48, 2
    with replicas(args.artifact, 1, args.out, ["--api-keys-file", str(keys)]):
        os.sched_setaffinity(0, {1})  # this client on the other core
        await _tenant_load(url, "key-b", 24, b_concurrency, 32)  # warm-up
        solo, shared, floods = [], [], []
        for _ in range(args.rounds):  # alone, then beside the flood, in each round
            solo.append(await _tenant_load(url, "key-b", b_requests, b_concurrency, 32))
            flood, until = [], asyncio.Event()
            # 600 tokens/min over ~36 tokens a request is ~17 requests a minute: ten times that is ~2.8 a second
            task = asyncio.create_task(_flood(url, "key-a", 10 * 600 / 36 / 60, until, flood))
            await asyncio.sleep(15)  # past A's first minute's burst (its bucket starts full): the steady flood
            shared.append(await _tenant_load(url, "key-b", b_requests, b_concurrency, 32))
            until.set()
            await task
            floods.append(flood)
        # the contrast: the same flood from a tenant with no limits
        flood, until = [], asyncio.Event()
        task = asyncio.create_task(_flood(url, "key-c", 10 * 600 / 36 / 60, until, flood))
        await asyncio.sleep(15)
        unlimited = await _tenant_load(url, "key-b", b_requests, b_concurrency, 32)
        until.set()
        await task
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer key-b"}).text
    (args.out / "tenants.json").write_text(json.dumps({"solo": solo, "shared": shared, "floods": floods}, indent=1))
    solo_t, shared_t = [_ttft(r) for r in solo], [_ttft(r) for r in shared]
    a_429 = [sum(r["status"] == 429 for r in f) for f in floods]
    a_ok = [sum(r["status"] == 200 for r in f) for f in floods]
    a_sent = [len(f) for f in floods]
    retry_after = sorted({r["retry_after"] for f in floods for r in f if r["status"] == 429})
    tenant_lines = [line for line in metrics.splitlines() if line.startswith("llmopt:tenant_requests_total{")]
    lines = ["One replica (core 0, one thread); clients on core 1. Tenant A: tokens_per_minute 600, "
             "max_concurrency 1, flooding at ten times that (2.8 requests/s of 16 tokens). Tenant B: no limits, "
             f"{b_requests} streaming completions (prompts of about 200 tokens, 32 generated) at concurrency "
             f"{b_concurrency}. Each round: B alone, then B beside the flood.", "",
             "| round | B p50 TTFT alone ms | B p50 TTFT beside the flood ms | ratio | A sent | A served | A 429 |",
             "|---|---|---|---|---|---|---|"]
    for i in range(args.rounds):
        lines.append(f"| {i + 1} | {solo_t[i]:.1f} | {shared_t[i]:.1f} | {shared_t[i] / solo_t[i]:.3f} | {a_sent[i]} | "
                     f"{a_ok[i]} | {a_429[i]} |")
    lines += ["", f"median ratio {med([s / o for s, o in zip(shared_t, solo_t)]):.3f}; Retry-After on A's 429s: "
              f"{', '.join(map(str, retry_after))} s. The same flood from a tenant without limits: B's p50 TTFT "
              f"{_ttft(unlimited):.1f} ms ({_ttft(unlimited) / med(solo_t):.2f}x the median alone).",
              "", "```", *tenant_lines, "```"]
    return "\n".join(lines)


def tenants(args) -> str:
    return asyncio.run(_tenants(args))


# ---------------------------------------------------------------- overhead
def overhead(args) -> str:
    load = ["--dataset", "sharegpt", "--num-prompts", "32", "--output-len", "32", "--ignore-eos",
            "--max-concurrency", "1", "--warmup", "2", "--seed", "0"]
    rows = {"direct": [], "router": []}
    with replicas(args.artifact, 1, args.out), router([FIRST_PORT], "cache-aware", args.out, args.route_args, core=1):
        for round_ in range(args.rounds + 1):  # round 0 warms both paths up and is left out
            for name, port in (("direct", FIRST_PORT), ("router", ROUTER_PORT)):
                report = bench(f"http://127.0.0.1:{port}", load, args.out / f"overhead-{name}-{round_}.json", core=0)
                if round_:
                    rows[name].append(report)
    lines = ["One replica (core 0, one thread) and the client (core 0: its work is the same both ways), the router "
             "alone on core 1; ShareGPT, 32 output tokens, one stream, the same 32 prompts in the same order each "
             f"run; {args.rounds} rounds interleaved after one left out.", "",
             "| round | TTFT direct ms | TTFT router ms | +ms | ITL direct ms | ITL router ms | +ms |",
             "|---|---|---|---|---|---|---|"]
    for i, (d, r) in enumerate(zip(rows["direct"], rows["router"])):
        lines.append(f"| {i + 1} | {d['median_ttft_ms']:.2f} | {r['median_ttft_ms']:.2f} | "
                     f"{r['median_ttft_ms'] - d['median_ttft_ms']:+.2f} | {d['median_itl_ms']:.3f} | "
                     f"{r['median_itl_ms']:.3f} | {r['median_itl_ms'] - d['median_itl_ms']:+.3f} |")
    # the same prompt through both paths (bench reports seconds) in the same round: a paired difference per request
    paired = [(rt - dt) * 1000 for d, r in zip(rows["direct"], rows["router"]) for dt, rt in zip(d["ttfts"], r["ttfts"])]
    itl = {name: [x for rep in reports for per in rep["itls"] for x in per] for name, reports in rows.items()}
    lines += ["", f"TTFT: median of the {len(paired)} paired differences (router - direct, same prompt, same round) "
              f"{med(paired):+.2f} ms; ITL: median of every inter-token gap "
              f"{med(itl['direct']) * 1000:.3f} ms direct, {med(itl['router']) * 1000:.3f} ms through the router "
              f"({(med(itl['router']) - med(itl['direct'])) * 1000:+.3f} ms)"]
    return "\n".join(lines)


MODES = {"cache": cache, "kill": kill, "tenants": tenants, "overhead": overhead}
ROUNDS = {"cache": 3, "kill": 1, "tenants": 5, "overhead": 5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", help="an llmopt artifact or source the replicas serve")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--rounds", type=int, default=None, help="default: cache 3, tenants 5, overhead 5")
    parser.add_argument("--kv-cache-memory", default="115MiB", help="cache: each replica's KV cache")
    parser.add_argument("--route-arg", dest="route_args", action="append", default=[],
                        help="an extra `llmopt route` option (repeatable), e.g. --route-arg=--balance-abs=2")
    parser.add_argument("--kill-requests", type=int, default=96)
    parser.add_argument("--kill-after", type=float, default=4.0)
    parser.add_argument("--eject-wait", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (one per replica)")
    args.rounds = args.rounds or ROUNDS[args.mode]
    args.out = args.out or Path(tempfile.mkdtemp(prefix=f"scale-out-{args.mode}-"))
    args.out.mkdir(parents=True, exist_ok=True)
    table = MODES[args.mode](args)
    (args.out / f"{args.mode}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
