"""Stats objects -> Prometheus series. The only module that knows prometheus-client.

Inputs are plain objects: the engine's PrefillStats / DecodeStats / VisionStats
(appliance/engine/stats.py) and SpeculativeStats (appliance/engine/speculative.py), the scheduler's RequestStats / StepTokens, and, read at scrape
time through callables the server binds, the latest SchedulerState and ThermalSnapshot. Names follow Prometheus conventions: `appliance_` prefix, base
units (seconds, hertz, celsius, ratio), `_total` on counters, explicit buckets.
"""
from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
                               CONTENT_TYPE_LATEST, GCCollector, PlatformCollector, ProcessCollector,
                               disable_created_metrics)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from appliance.engine.stats import DecodeStats, PrefillStats, VisionStats
from appliance.engine.retrieval_stats import RetrievalStats
from appliance.engine.speculative import SpeculativeStats
from appliance.weights.report import CacheReport
from appliance.server.scheduler import OUTCOMES, RequestStats, StepTokens
from appliance.telemetry.cpu_wait import CpuWait

DECODE_TOKEN_BUCKETS = (0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                        0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
                   100.0, 200.0, 400.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                   640.0, 1200.0)
CONTEXT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# Outcomes beyond the scheduler's: refused at the door (503) and rejected as invalid (4xx).
REQUEST_OUTCOMES = OUTCOMES + ("rejected", "invalid")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


class _LiveCollector:
    """Series read at scrape time: the latest scheduler state and thermal snapshot, the threads' CPU wait,
    the kernels' thread pool counters."""

    def __init__(self, owner: "Metrics"):
        self.owner = owner

    def describe(self):
        return []

    def collect(self):
        yield from self._scheduler()
        yield from self._prefix_cache()
        yield from self._thermal()
        yield from self._cpu_wait()
        yield from self._kernel_pool()

    def _scheduler(self):
        state = self.owner.queue_state()
        running = GaugeMetricFamily("appliance_requests_running", "Requests decoding now.")
        waiting = GaugeMetricFamily("appliance_requests_waiting", "Requests queued for a decode slot.")
        used = GaugeMetricFamily("appliance_kv_cache_used_blocks", "KV cache blocks in use.")
        total = GaugeMetricFamily("appliance_kv_cache_capacity_blocks", "KV cache blocks in the pool.")
        usage = GaugeMetricFamily("appliance_kv_cache_usage_ratio", "Share of KV cache blocks in use.")
        ctx = GaugeMetricFamily("appliance_running_context_max_tokens",
                                "Longest context among running requests, in tokens.")
        ctx_sum = GaugeMetricFamily("appliance_running_context_tokens",
                                    "Context tokens held by all running requests together.")
        preempted = CounterMetricFamily("appliance_kv_preemptions",
                                        "Running requests paused (and resumed later by recomputing) because "
                                        "the KV cache could not grow them.")
        tokens = GaugeMetricFamily("appliance_kv_cache_capacity_tokens", "KV cache pool size in tokens.")
        cached = GaugeMetricFamily("appliance_kv_cache_cached_blocks",
                                   "Idle KV blocks the prefix cache keeps for later prompts (reusable).")
        step = GaugeMetricFamily("appliance_step_tokens",
                                 "Rows one step computes while streams decode (their tokens plus prompt chunks).")
        if state is not None:
            preempted.add_metric([], state.preemptions)
            tokens.add_metric([], state.kv_tokens_total)
            cached.add_metric([], state.kv_blocks_cached)
            step.add_metric([], state.step_tokens)
            running.add_metric([], state.running)
            waiting.add_metric([], state.waiting)
            used.add_metric([], state.kv_blocks_used)
            total.add_metric([], state.kv_blocks_total)
            usage.add_metric([], state.kv_blocks_used / state.kv_blocks_total if state.kv_blocks_total else 0.0)
            ctx.add_metric([], max(state.contexts, default=0))
            ctx_sum.add_metric([], sum(state.contexts))
        yield from (running, waiting, used, total, usage, ctx, ctx_sum, preempted, tokens, cached, step)

    def _prefix_cache(self):
        """The prefix cache and its disk tier, from the engine's PrefixCacheStats in the state."""
        state = self.owner.queue_state()
        stats = getattr(state, "prefix", None)
        if stats is None:
            return
        yield _counter("appliance_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.query_tokens)
        yield _counter("appliance_prefix_cache_hits", "Prompt tokens the prefix cache gave (not computed).",
                       stats.hit_tokens)
        yield _counter("appliance_prefix_cache_disk_hits", "Prompt tokens the prefix cache read back from disk.",
                       stats.disk_hit_tokens)
        yield _counter("appliance_prefix_cache_evictions", "Idle cached KV blocks reused for other rows.",
                       stats.evictions)
        disk = stats.disk
        if disk is None:
            return
        yield _gauge("appliance_kv_disk_bytes", "Bytes of KV blocks in the cache directory.", disk.bytes)
        yield _gauge("appliance_kv_disk_capacity_bytes", "Bytes the cache directory may hold.", disk.max_bytes)
        yield _gauge("appliance_kv_disk_files", "KV block files in the cache directory.", disk.files)
        yield _counter("appliance_kv_disk_written_blocks", "KV blocks written to the cache directory.", disk.written)
        yield _counter("appliance_kv_disk_loaded_blocks", "KV blocks read back from the cache directory.",
                       disk.loaded)
        yield _counter("appliance_kv_disk_dropped_blocks",
                       "KV blocks not written: the writer was behind or the disk failed.", disk.dropped)
        rejected = CounterMetricFamily("appliance_kv_disk_rejected_files",
                                       "KV block files skipped and removed, never used, by reason "
                                       "(stale format, foreign model or layout, truncated, corrupt).",
                                       labels=["reason"])
        for reason, n in sorted(disk.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected

    def _thermal(self):
        snap = self.owner.thermal_state()
        temp = GaugeMetricFamily("appliance_thermal_zone_temperature_celsius",
                                 "Thermal zone temperature (zone = sysfs type).", labels=["zone"])
        cur = GaugeMetricFamily("appliance_cpu_frequency_hertz",
                                "Current CPU frequency per cpufreq policy.", labels=["policy", "cpus"])
        cap = GaugeMetricFamily("appliance_cpu_frequency_max_hertz",
                                "Maximum CPU frequency in force (scaling_max_freq) per policy.",
                                labels=["policy", "cpus"])
        hw = GaugeMetricFamily("appliance_cpu_frequency_hardware_max_hertz",
                               "Hardware maximum CPU frequency (cpuinfo_max_freq) per policy.",
                               labels=["policy", "cpus"])
        thr = GaugeMetricFamily("appliance_cpu_throttled",
                                "1 while the policy is throttled (held below max while busy, "
                                "or a passive trip point crossed).", labels=["policy", "cpus"])
        secs = CounterMetricFamily("appliance_cpu_throttled_seconds",
                                   "Seconds the policy spent throttled.", labels=["policy", "cpus"])
        up = GaugeMetricFamily("appliance_thermal_throttled",
                               "1 while any CPU policy is throttled.")
        if snap is not None:
            for z in snap.zones:
                if z.temp_c is not None:          # a missing sensor is unknown: no sample
                    temp.add_metric([z.name], z.temp_c)
            seconds = snap.throttled_seconds
            for p in snap.policies:
                labels = [p.name, p.cluster]
                if p.cur_hz is not None:
                    cur.add_metric(labels, p.cur_hz)
                if p.max_hz is not None:
                    cap.add_metric(labels, p.max_hz)
                if p.hw_max_hz is not None:
                    hw.add_metric(labels, p.hw_max_hz)
                thr.add_metric(labels, 1.0 if p.throttled else 0.0)
                secs.add_metric(labels, seconds.get(p.name, 0.0))
            up.add_metric([], 1.0 if snap.throttled else 0.0)
        yield from (temp, cur, cap, hw, thr, secs, up)

    def _cpu_wait(self):
        times = self.owner.cpu_wait.read() if self.owner.cpu_wait is not None else None
        if times is not None:      # a kernel without schedstat: no series rather than zeros
            yield _counter("appliance_cpu_run_seconds",
                           "CPU time the appliance's threads ran (the kernel's schedstat, all threads).",
                           times.run_s)
            yield _counter("appliance_cpu_wait_seconds",
                           "Time the appliance's threads were ready to run but waited for a CPU (the kernel's "
                           "run-queue wait): another process on their cores.", times.wait_s)

    def _kernel_pool(self):
        stats = self.owner.kernel_pool()
        if not stats:
            return
        yield _counter("appliance_kernel_pool_jobs", "Kernel calls the kernels' thread pool ran on several threads.",
                       stats["jobs"])
        chunks = CounterMetricFamily("appliance_kernel_pool_chunks",
                                     "Chunks of those calls, by the thread that ran them: the calling thread or a "
                                     "pool worker.", labels=["thread"])
        chunks.add_metric(["caller"], stats["caller_chunks"])
        chunks.add_metric(["worker"], stats["worker_chunks"])
        yield chunks
        yield _counter("appliance_kernel_pool_caller_sleeps",
                       "Times a calling thread slept for a chunk a worker held without progress (the worker's core "
                       "taken by another thread).", stats["caller_sleeps"])
        yield _counter("appliance_kernel_pool_chunks_taken_back",
                       "Chunks of decode-sized GEMMs and decode attention a calling thread computed itself instead of "
                       "waiting for the worker that held them without progress.", stats["taken_back"])


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class Metrics:
    """Owns one registry (so several apps can live in one test process)."""

    def __init__(self, registry: CollectorRegistry | None = None, process_metrics: bool = True):
        disable_created_metrics()   # process-wide: the *_created series only double the scrape
        r = self.registry = registry or CollectorRegistry()
        self.queue_state = lambda: None        # -> SchedulerState | None (bind)
        self.thermal_state = lambda: None      # -> ThermalSnapshot | None (bind)
        self.kernel_pool = lambda: None        # -> the kernels' pool_stats() dict | None (bind)
        self.cpu_wait = CpuWait() if process_metrics else None
        if process_metrics:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        self.decode_token = Histogram(
            "appliance_decode_token_seconds",
            "Decode time per output token: the step time each running sequence waited for its token.",
            buckets=DECODE_TOKEN_BUCKETS, registry=r)
        self.decode_attention = Histogram(
            "appliance_decode_attention_ratio", "Share of a decode step spent in attention.",
            buckets=RATIO_BUCKETS, registry=r)
        self.decode_attention_last = Gauge(
            "appliance_decode_attention_last_ratio", "Attention share of the latest decode step.",
            registry=r)
        self.decode_batch = Histogram(
            "appliance_decode_batch_size", "Sequences decoded together per step.",
            buckets=BATCH_BUCKETS, registry=r)
        self.decode_context = Histogram(
            "appliance_decode_context_tokens", "Context length of each decoded sequence, per step.",
            buckets=CONTEXT_BUCKETS, registry=r)
        self.prefill = Histogram(
            "appliance_prefill_seconds", "Prefill time (one prompt, or one chunk of it).",
            buckets=PREFILL_BUCKETS, registry=r)
        self.vision_encode = Histogram(
            "appliance_vision_encode_seconds", "Vision tower time for one request's images.",
            buckets=PREFILL_BUCKETS, registry=r)
        self.prefill_attention = Histogram(
            "appliance_prefill_attention_ratio", "Share of a prefill spent in attention.",
            buckets=RATIO_BUCKETS, registry=r)
        self.ttft = Histogram(
            "appliance_time_to_first_token_seconds", "Request arrival to its first token.",
            buckets=PREFILL_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "appliance_request_queue_seconds", "Request arrival to a decode slot.",
            buckets=REQUEST_BUCKETS, registry=r)
        self.e2e = Histogram(
            "appliance_request_duration_seconds", "Request arrival to its last token (end to end).",
            buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "appliance_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generated_tokens = Counter(
            "appliance_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "appliance_requests", "Requests by outcome.", labelnames=["outcome"], registry=r)
        for outcome in REQUEST_OUTCOMES:
            self.requests.labels(outcome)
        # One series per API key name (bounded by the key file) and status class; client "-":
        # requests that came without a valid key (a revoked client still trying shows here).
        self.client_requests = Counter(
            "appliance_client_requests", "Requests per client (the API key's name) by HTTP status class.",
            labelnames=["client", "status"], registry=r)
        self.spec_draft_tokens = Counter(
            "appliance_spec_draft_tokens", "Tokens speculative decoding drafted and verified.", registry=r)
        self.spec_accepted_tokens = Counter(
            "appliance_spec_accepted_tokens", "Drafted tokens the model accepted (emitted as drafted).", registry=r)
        self.spec_position_drafts = Counter(
            "appliance_spec_draft_tokens_by_position", "Drafted tokens at each position of their draft (1: the "
            "first guessed token).", labelnames=["position"], registry=r)
        self.spec_position_accepted = Counter(
            "appliance_spec_accepted_tokens_by_position", "Accepted drafted tokens at each position of their draft: "
            "over appliance_spec_draft_tokens_by_position, the acceptance rate there.", labelnames=["position"],
            registry=r)
        for position in ("1", "2", "3", "4"):
            self.spec_position_drafts.labels(position)
            self.spec_position_accepted.labels(position)
        self.retrieval_inputs = Counter(
            "appliance_retrieval_inputs", "Inputs embedded (task embed) or documents scored (task rerank).",
            labelnames=["task"], registry=r)
        self.retrieval_duration = Histogram(
            "appliance_retrieval_seconds", "Engine time of one embedding or rerank request, all its passes.",
            labelnames=["task"], buckets=PREFILL_BUCKETS, registry=r)
        for task in ("embed", "rerank"):
            self.retrieval_inputs.labels(task)
            self.retrieval_duration.labels(task)
        self.served_model = Gauge(
            "appliance_served_model_info", "What this server answers to: each name `model` may take, and the "
            "task it serves (chat, embed, rerank); value 1.", labelnames=["model", "served_name", "task"],
            registry=r)
        self.model_info = Gauge(
            "appliance_model_info", "The served model and engine settings (value 1).",
            labelnames=["model", "model_type", "weights", "kv", "kernel_path", "threads", "max_context",
                        "layers", "sparse_attn"], registry=r)
        self.build_info = Gauge(
            "appliance_build_info", "Versions of the running server (value 1).",
            labelnames=["version", "python", "gunicorn", "machine"], registry=r)
        self.build_info.labels(_version("appliance"), platform.python_version(),
                               _version("gunicorn"), platform.machine()).set(1)
        self.loaded = Gauge("appliance_model_loaded", "1 once the model is loaded and serving.",
                            registry=r)
        self.weight_cache_rejected = Counter(
            "appliance_weight_cache_rejected", "Quantized weight cache files refused at load and rebuilt, "
            "by kind (unreadable, foreign: another model/format/build, corrupt: a checksum).",
            labelnames=["kind"], registry=r)
        for kind in ("unreadable", "foreign", "corrupt"):
            self.weight_cache_rejected.labels(kind)
        self.weight_cache_verify = Gauge(
            "appliance_weight_cache_verify_seconds", "Time the last load spent checking the weight cache's "
            "checksums.", registry=r)
        self.weight_hugepages = Gauge(
            "appliance_weight_hugepage_bytes", "Bytes of the matrices every decode step streams that the last "
            "load copied into huge pages (0: all read from the weight cache's mapping, e.g. transparent huge "
            "pages off).", registry=r)
        # NaN until the start-up selftest has run: no verdict yet is neither a pass nor a fail.
        self.selftest_ok = Gauge("appliance_selftest_ok",
                                 "1 if the compiled kernels agreed with the portable reference at start.",
                                 registry=r)
        self.selftest_ok.set_function(lambda: self._selftest)
        self._selftest = float("nan")
        r.register(_LiveCollector(self))

    # ---- wiring --------------------------------------------------------------

    def bind(self, queue=None, thermal=None, kernel_pool=None) -> None:
        """Sources read at scrape time: queue() -> the scheduler's latest SchedulerState,
        thermal() -> the thermal watch's latest ThermalSnapshot, kernel_pool() -> the kernels'
        thread pool counters (any may return None)."""
        if queue is not None:
            self.queue_state = queue
        if thermal is not None:
            self.thermal_state = thermal
        if kernel_pool is not None:
            self.kernel_pool = kernel_pool

    def set_model(self, name: str, info: dict) -> None:
        def s(key):
            v = info.get(key)
            return "" if v is None else str(v)
        self.model_info.labels(name, s("model_type"), s("weights"), s("kv"), s("kernel_path"), s("threads"),
                               s("max_context"), s("layers"), s("sparse")).set(1)
        self.loaded.set(1)

    def set_served(self, model: str, names, task: str) -> None:
        """The served names and task (one instance per model on a board: the fleet tells them apart)."""
        self.served_model.clear()
        for name in names:
            self.served_model.labels(model, name, task).set(1)

    # ---- inputs ---------------------------------------------------------------

    def set_selftest(self, ok: bool) -> None:
        self._selftest = 1.0 if ok else 0.0

    def observe(self, stats) -> None:
        """Any stats object from the engine or the scheduler."""
        if isinstance(stats, DecodeStats):
            # a sequence that got m tokens in the step (speculative decoding) waited total_s / m for each
            for m in stats.tokens or [1] * max(1, stats.batch):
                for _ in range(m):
                    self.decode_token.observe(stats.total_s / m)
            self.decode_attention.observe(stats.attn_share)
            self.decode_attention_last.set(stats.attn_share)
            self.decode_batch.observe(stats.batch)
            for c in stats.contexts or [stats.n_context]:
                self.decode_context.observe(c)
        elif isinstance(stats, SpeculativeStats):
            self.spec_draft_tokens.inc(stats.draft_tokens)
            self.spec_accepted_tokens.inc(stats.accepted_tokens)
            for i, (drafted, accepted) in enumerate(zip(stats.drafted, stats.accepted)):
                self.spec_position_drafts.labels(str(i + 1)).inc(drafted)
                self.spec_position_accepted.labels(str(i + 1)).inc(accepted)
        elif isinstance(stats, VisionStats):
            self.vision_encode.observe(stats.total_s)
        elif isinstance(stats, PrefillStats):
            self.prefill.observe(stats.total_s)
            self.prefill_attention.observe(stats.attn_share)
        elif isinstance(stats, RetrievalStats):
            self.retrieval_inputs.labels(stats.task).inc(stats.n_inputs)
            self.retrieval_duration.labels(stats.task).observe(stats.total_s)
        elif isinstance(stats, StepTokens):
            if stats.prompt_tokens:
                self.prompt_tokens.inc(stats.prompt_tokens)
            if stats.generated_tokens:
                self.generated_tokens.inc(stats.generated_tokens)
        elif isinstance(stats, CacheReport):
            for _, kind, _ in stats.rejected:
                self.weight_cache_rejected.labels(kind).inc()
            self.weight_cache_verify.set(stats.verify_s)
            self.weight_hugepages.set(stats.hugepage_bytes)
        elif isinstance(stats, RequestStats):
            self.requests.labels(stats.outcome).inc()
            self.queue_time.observe(stats.queue_s)
            if stats.ttft_s is not None:
                self.ttft.observe(stats.ttft_s)
            if stats.outcome in ("stop", "length"):
                self.e2e.observe(stats.e2e_s)

    def count(self, outcome: str) -> None:
        """Requests that never reached the scheduler: 'rejected' (503) or 'invalid' (4xx)."""
        self.requests.labels(outcome).inc()

    def count_client(self, client: str, status: str) -> None:
        """One finished HTTP request of a client (status: "200", "401", ...)."""
        self.client_requests.labels(client, f"{status[:1]}xx" if status[:1].isdigit() else "other").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

