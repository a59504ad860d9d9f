"""What one server process holds: settings, engine, scheduler, metrics, thermal watch.

The model loads in a background thread so that /health can answer 503 "loading"
at once; the scheduler starts when the engine is ready.
"""
from __future__ import annotations

import logging
import threading
import time

from appliance.config import Settings, model_dir_problem
from appliance.telemetry.metrics import Metrics
from appliance.server.live import LiveStats
from appliance.telemetry.thermal import ThermalMonitor

log = logging.getLogger("appliance.server")


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics | None = None):
        self.settings = settings
        self.status = "loading"          # loading | ready | failed | draining
        self.error: str | None = None
        self.engine = None
        self.scheduler = None
        self.info: dict = {}
        self.started = time.time()
        # While loading: {"stage", "done", "total", "seconds"} of the weights' load (for /health).
        self.load_progress: dict | None = None
        self.ready_event = threading.Event()
        self.metrics = metrics or Metrics()
        cpu_wait = self.metrics.cpu_wait
        self.live = LiveStats(queue_state=self._queue_state, cpu_times=cpu_wait.read if cpu_wait is not None else None)
        self.thermal = ThermalMonitor(settings.sysfs_root, settings.thermal_interval)
        self.metrics.bind(thermal=self.thermal.snapshot)

    def _queue_state(self) -> tuple[int, int]:
        s = self.scheduler.state if self.scheduler is not None else None
        return (s.running, s.waiting) if s is not None else (0, 0)

    # ---- lifecycle ------------------------------------------------------------

    def start(self, engine=None, background: bool = True) -> "Runtime":
        self.thermal.start()
        if engine is not None:
            self._serve(engine)
        elif background:
            threading.Thread(target=self._load, name="model-loader", daemon=True).start()
        else:
            self._load()
        return self

    def _load(self) -> None:
        s = self.settings
        t0 = time.perf_counter()

        def on_progress(stage: str, done: int, total: int) -> None:
            self.load_progress = {"stage": stage, "done": done, "total": total,
                                  "seconds": round(time.perf_counter() - t0, 1)}

        problem = model_dir_problem(s)
        if problem:
            self._fail(problem)
            return
        try:
            from appliance import Engine
            engine = Engine.load(path=s.model, weights=s.weights, kv=s.kv, threads=s.threads,
                                 max_context=s.max_context, sparse=s.sparse_config(),
                                 kv_cache_tokens=s.kv_cache_tokens, kv_cache_memory=s.kv_cache_memory,
                                 prefix_cache=not s.disable_prefix_cache, kv_cache_dir=s.kv_cache_dir,
                                 kv_cache_disk_bytes=s.kv_cache_disk_bytes, on_progress=on_progress)
        except Exception as e:
            log.exception("loading the model failed")
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.load_progress = None
        self._selftest(engine)
        self._serve(engine)
        log.info("%s", ready_line(engine.info(), time.perf_counter() - t0))

    def _fail(self, error: str) -> None:
        """Serve the reason instead of a model: /health, /ready and every API call say it."""
        self.status = "failed"
        self.error = error
        log.error("not serving: %s", error)
        self.ready_event.set()

    def _selftest(self, engine) -> None:
        """The engine's kernel selftest, once, for appliance_selftest_ok.

        Serving goes on either way: the fleet alert, not a dead board, is the answer to a
        failure here (Ansible's selftest already refused to start a release that fails it).
        """
        try:
            report = engine.kernel_selftest()
        except Exception as e:           # not built, or a check crashed: a fail, said plainly
            log.error("kernel selftest could not run: %s", e)
            self.metrics.set_selftest(False)
            return
        if report is None:               # the numpy twin: no compiled kernels to check
            return
        failed = [c["name"] for c in report["checks"] if not c["ok"]]
        if report["ok"]:
            log.info("kernel selftest ok (%s path)", report["kernel_path"])
        else:
            log.error("kernel selftest FAILED (%s path): %s", report["kernel_path"],
                      report.get("problem") or ", ".join(failed))
        self.metrics.set_selftest(report["ok"])

    def _serve(self, engine) -> None:
        from appliance.server.scheduler import Scheduler

        s = self.settings
        engine.add_stats_listener(self.metrics.observe)
        engine.add_stats_listener(self.live.observe)
        scheduler = Scheduler(engine, max_queue=s.max_queue, max_batch=s.max_batch,
                              request_timeout=s.request_timeout, max_step_tokens=s.max_step_tokens)
        scheduler.add_listener(self.metrics.observe)
        scheduler.add_listener(self.live.observe)
        self.info = dict(engine.info())
        self.info.setdefault("sparse", s.sparse_config())
        self.metrics.set_model(engine.model_name, self.info)
        if engine.weight_cache is not None:
            self.metrics.observe(engine.weight_cache)
        self.metrics.bind(queue=lambda: scheduler.state,
                          kernel_pool=getattr(engine, "kernel_pool_stats", None))   # test doubles may lack it
        self.engine = engine
        self.scheduler = scheduler.start()
        self.status = "ready"
        self.ready_event.set()

    def begin_drain(self, grace: float | None = None) -> None:
        """SIGTERM: stop admitting; running requests get the grace period to finish."""
        grace = self.settings.grace_period if grace is None else grace
        if self.status == "ready":
            self.status = "draining"
        if self.scheduler is not None:
            self.scheduler.begin_drain(grace)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.engine is not None:
            # The prefix cache's blocks go to --kv-cache-dir for the next start (a restart, an upgrade).
            t0 = time.perf_counter()
            complete = self.engine.close(timeout=max(5.0, self.settings.grace_period))
            stats = self.engine.prefix_cache_stats()
            if stats is not None and stats.disk is not None:
                log.info("KV cache kept on disk in %.1f s: %d files, %.1f MiB%s", time.perf_counter() - t0,
                         stats.disk.files, stats.disk.bytes / 2**20, "" if complete else " (time ran out)")
        self.thermal.stop()

    # ---- facts ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def idle(self) -> bool:
        """Nothing running or waiting (always, before the scheduler exists)."""
        return self.scheduler is None or self.scheduler.idle()

    def model_facts(self) -> dict:
        if self.engine is None:
            return {}
        return {"id": self.engine.model_name, "max_context": self.engine.max_context, **self.info,
                "generation_defaults": dict(self.engine.generation_defaults or {})}

    def queue_facts(self) -> dict:
        st = self.scheduler.state if self.scheduler is not None else None
        return {
            "running": st.running if st else 0,
            "waiting": st.waiting if st else 0,
            "kv_blocks_used": st.kv_blocks_used if st else 0,
            "kv_blocks_total": st.kv_blocks_total if st else 0,
            "kv_blocks_cached": st.kv_blocks_cached if st else 0,
            "kv_tokens_total": st.kv_tokens_total if st else 0,
            "preemptions": st.preemptions if st else 0,
            "step_tokens": st.step_tokens if st else 0,
            "max_batch": self.settings.max_batch,
            "max_queue": self.settings.max_queue,
            "prefix_cache": _prefix_facts(st.prefix if st else None),
        }


def _prefix_facts(stats) -> dict | None:
    """The prefix cache as /health and the dashboard show it (tokens, and the disk tier)."""
    if stats is None:
        return None
    out = {"query_tokens": stats.query_tokens, "hit_tokens": stats.hit_tokens,
           "hit_ratio": round(stats.hit_ratio, 4), "disk_hit_tokens": stats.disk_hit_tokens,
           "blocks_cached": stats.blocks_cached, "blocks_idle": stats.blocks_idle}
    if stats.disk is not None:
        d = stats.disk
        out["disk"] = {"files": d.files, "bytes": d.bytes, "max_bytes": d.max_bytes, "written": d.written,
                       "loaded": d.loaded, "rejected": dict(d.rejected)}
    return out


def ready_line(info: dict, seconds: float) -> str:
    """The one line that says the server is serving, and with what."""
    sparse = info.get("sparse")
    attention = (f"block-sparse attention k={sparse['k']}" if sparse else "exact attention")
    cache = "prefix cache " + ("on" + (f", kept in {info['kv_cache_dir']}" if info.get("kv_cache_dir") else "")
                               if info.get("prefix_cache") else "off")
    return (f"serving {info['model']} ({info['model_type']}, {info['layers']} layers): {info['weights']} weights "
            f"{info['weight_bytes'] / 2**20:.0f} MiB, {info['kv']} KV pool of {info['kv_tokens_total']} tokens "
            f"({info['kv_pool_bytes'] / 2**20:.0f} MiB), {attention}, {cache}, context {info['max_context']}, "
            f"{info['threads']} threads on the {info['kernel_path']} kernels; loaded in {seconds:.1f} s")
