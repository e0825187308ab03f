"""What the TRL rollout refuses, each with one error that names the setting and the fix: a TRL outside the tested
range (its ``rollout_func`` is experimental), generation settings the engine cannot honour, a second generation
engine, a PEFT model, tools and environments, another tokenizer, a process slice that is not whole GRPO groups.

Everything TRL would otherwise apply silently differently (a ``min_p``, a repetition penalty, extra
``generation_kwargs``) is refused rather than ignored: the responses would come from another distribution than the
one TRL's config names.

Departures: none (checks).
"""
from __future__ import annotations

from ..errors import BadInput, MissingDependency
from ..model.sampling import SamplingConfig

TRL_SUPPORTED = ">=1.16,<1.17"
"""The TRL versions this integration is tested with (``GRPOTrainer(rollout_func=...)`` is experimental in TRL)."""


def check_trl_version(installed: str | None = None) -> str:
    """The installed TRL's version, refused with the installed and the needed versions when outside
    :data:`TRL_SUPPORTED` or missing."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    if installed is None:
        try:
            import trl
        except ImportError:
            raise MissingDependency(f"the TRL rollout needs trl{TRL_SUPPORTED}, which is not installed: pip install "
                                    f"'trl{TRL_SUPPORTED}' (or python -m tltlib setup, which installs it)") from None
        installed = trl.__version__
    if Version(installed) not in SpecifierSet(TRL_SUPPORTED):
        raise MissingDependency(f"the TRL rollout is tested with trl{TRL_SUPPORTED} (GRPOTrainer's rollout_func is "
                                f"experimental and changes between releases), but trl {installed} is installed: "
                                f"pip install 'trl{TRL_SUPPORTED}'")
    return installed


def sampling_of(args) -> SamplingConfig:
    """The sampling distribution TRL's ``GRPOConfig`` asks for, as the engine samples it; refuses what it cannot
    honour (``min_p``, a repetition penalty, ``generation_kwargs``, no ``max_completion_length``)."""
    refused = []
    if getattr(args, "min_p", None) not in (None, 0, 0.0):
        refused.append(f"min_p={args.min_p}")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        refused.append(f"repetition_penalty={args.repetition_penalty}")
    if getattr(args, "generation_kwargs", None):
        refused.append(f"generation_kwargs={args.generation_kwargs!r}")
    if refused:
        raise BadInput(f"the TRL rollout samples with temperature, top_p and top_k only; GRPOConfig sets "
                       f"{', '.join(refused)}, which it cannot honour (the responses would come from another "
                       "distribution than the config names): remove them from GRPOConfig")
    if not args.max_completion_length:
        raise BadInput("GRPOConfig.max_completion_length is not set: the TRL rollout needs a length budget")
    if not args.temperature > 0:
        raise BadInput(f"GRPOConfig.temperature is {args.temperature}: GRPO needs sampled groups (at 0 every "
                       "completion of a prompt is the same, and TRL's loss divides by the temperature); give a "
                       "temperature > 0")
    return SamplingConfig(temperature=float(args.temperature), top_k=int(args.top_k or 0),
                          top_p=float(args.top_p if args.top_p is not None else 1.0),
                          max_new_tokens=int(args.max_completion_length))


def check_trainer(trainer) -> None:
    """Refuse a TRL trainer set up in a way the TRL rollout cannot serve (each with its reason and fix)."""
    from .trl_weights import is_peft
    args = trainer.args
    if getattr(args, "use_vllm", False):
        raise BadInput("GRPOConfig(use_vllm=True) together with the TLT rollout_func would run two generation "
                       "engines (TRL would also sync its weights into vLLM each step): set use_vllm=False")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise BadInput("GRPOConfig(use_transformers_continuous_batching=True) names transformers' generation, "
                       "which the TLT rollout_func replaces: set it to False")
    if is_peft(trainer.model):
        raise BadInput("TRL's model is PEFT-wrapped (LoRA/adapters): the TLT rollout decodes with a full copy of "
                       "the policy and would need the adapters merged into it at every sync, which it does not "
                       "do; train the full model (no peft_config) or merge the adapters first (merge_and_unload)")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise BadInput("the TLT rollout_func generates single-turn completions; TRL's tools / environment_factory "
                       "run a multi-turn loop through TRL's own generation: drop them or the rollout_func")
    if getattr(trainer, "is_fsdp_enabled", False) or _zero3(trainer):
        raise BadInput("TRL's model is sharded (FSDP or DeepSpeed ZeRO-3): the TLT rollout copies the whole policy "
                       "into its own model on every process and does not gather shards; use data parallelism "
                       "(DDP) or ZeRO-1/2, where every process holds the full weights")
    if getattr(trainer, "_is_vlm", False):
        raise BadInput("TRL's model is a vision-language model: the TLT rollout decodes text-only decoders")


def _zero3(trainer) -> bool:
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "deepspeed_plugin", None)
    return plugin is not None and getattr(plugin, "zero_stage", 0) == 3


def check_tokenizer(trl_tokenizer, ours, source: str) -> None:
    """Refuse a TRL tokenizer that differs from the rollout model's (``source``): the first difference named."""
    def special(tok):
        return {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tok = getattr(trl_tokenizer, "tokenizer", trl_tokenizer)         # a processor's tokenizer
    problems = []
    va, vb = tok.get_vocab(), ours.get_vocab()
    if va != vb:
        only_trl = sorted(set(va.items()) - set(vb.items()))[:3]
        only_ours = sorted(set(vb.items()) - set(va.items()))[:3]
        problems.append(f"the vocabularies differ ({len(va)} vs {len(vb)} tokens; TRL's has {only_trl}, "
                        f"{source}'s has {only_ours})")
    for k, v in special(ours).items():
        if v is not None and special(tok)[k] != v:
            problems.append(f"{k} is {special(tok)[k]} in TRL's tokenizer, {v} in {source}'s")
    if problems:
        raise BadInput(f"TRL's tokenizer (processing_class) differs from the tokenizer of {source}: "
                       f"{'; '.join(problems)}; give GRPOTrainer the tokenizer of the model the rollout decodes "
                       "(processing_class=AutoTokenizer.from_pretrained(model_folder))")


def groups(prompts: list, num_generations: int, batch_rows: str) -> tuple[list[int], int]:
    """(the index of each group's first prompt in this process's slice, completions per group here). TRL's
    RepeatSampler puts a prompt's ``num_generations`` rows one after another, and with several processes a group may
    be split between them: the slice must be runs of equal prompts, all of one length that divides
    ``num_generations`` (whole groups, or every group split evenly); refused otherwise, naming ``batch_rows`` (the
    setting that sizes the slice)."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append((start, i - start))
            start = i
    sizes = {n for _, n in runs}
    if all(n % num_generations == 0 for n in sizes):
        g = num_generations                      # whole groups (a prompt drawn twice in a row: two groups)
    elif len(sizes) == 1 and num_generations % next(iter(sizes)) == 0:
        g = next(iter(sizes))                    # every group split evenly between processes
    else:
        g = 0
    if g:
        return [s + k for s, n in runs for k in range(0, n, g)], g
    raise BadInput(f"this process received {len(prompts)} prompts in runs of {sorted(sizes)} equal prompts, which "
                   f"split the GRPO groups of num_generations={num_generations} unevenly: the TLT rollout samples "
                   f"each process's rows of a group together; make {batch_rows} a multiple of num_generations, or "
                   "a divisor of it that every process gets whole (TRL's RepeatSampler order; a custom sampler is "
                   "not supported)")
