"""GRPO with TRL, its rollouts served by TLT: a TRL script with one extra argument, ``rollout_func``.

    python examples/trl_grpo_tlt.py                                   # the tiny reasoner, 4 steps, on this machine
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo_tlt.py   # two processes (CPU: gloo; GPUs: nccl)
    python examples/trl_grpo_tlt.py --generation trl                  # the same run with TRL's own generation

Everything but the ``rollout_func=`` line is plain TRL: a dataset with a ``prompt`` column (and the ``answer`` the
reward reads), a reward function with TRL's signature, a ``GRPOConfig``. tltlib's adaptive engine samples the
``num_generations`` completions of each prompt (speculative decoding switched on as rows finish, the strategy chosen
by its tuner), returns their exact sampling log-probs, and trains the drafter on the rollout's hidden states; TRL does
the rest (rewards, loss, optimizer, logging, checkpoints, accelerate). Metrics appear in TRL's logs under tltlib's
names (``spec/accept_len_mean``, ``drafter/loss``, ``time/rollout_s`` ...); see docs/trl.md.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tltlib.integrations import tlt_rollout_func
from tltlib.rl import TLTConfig, accuracy_reward
from tltlib.tasks import generate_task


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="data/tiny-reasoner", help="a model folder (transformers layout)")
    p.add_argument("--drafter", default="data/tiny-reasoner-drafter", help="its EAGLE drafter ('' = none)")
    p.add_argument("--task", default="chain", choices=["chain", "words"], help="the generated task (words: SmolLM2)")
    p.add_argument("--generation", default="tlt", choices=["tlt", "tlt-off", "trl"],
                   help="tlt: adaptive SD + online drafter; tlt-off: tltlib's engine without SD; trl: TRL's own")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per process and step")
    p.add_argument("--max-completion-length", type=int, default=512)
    p.add_argument("--output-dir", default="runs/trl-grpo-tlt")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")     # rollout_func is experimental in TRL

    problems = generate_task(a.task, 4096, seed=a.seed)
    dataset = Dataset.from_list([{"prompt": q.prompt, "answer": q.answer} for q in problems])
    config = GRPOConfig(
        output_dir=a.output_dir, max_steps=a.max_steps, seed=a.seed,
        num_generations=a.num_generations, per_device_train_batch_size=a.prompts_per_step * a.num_generations,
        max_completion_length=a.max_completion_length, temperature=1.0, learning_rate=1e-5,
        bf16=torch.cuda.is_available(),   # TRL's default on a GPU; fp32 on a CPU (the rollout computes in it too)
        use_cpu=not torch.cuda.is_available(),   # on a CPU: accelerate's multi-CPU (gloo) under several processes
        logging_steps=1, report_to=[], save_steps=2)
    rollout = None
    if a.generation != "trl":
        rollout = tlt_rollout_func(a.model, a.drafter or None,
                                   tlt=TLTConfig(speculative="adaptive" if a.generation == "tlt" else "off",
                                                 online_drafter=a.generation == "tlt"))
    trainer = GRPOTrainer(model=a.model, reward_funcs=[accuracy_reward], args=config, train_dataset=dataset,
                          rollout_func=rollout)
    trainer.train()
    if trainer.is_world_process_zero():         # every logged step, for plots and benches
        with open(os.path.join(a.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)


if __name__ == "__main__":
    main()
