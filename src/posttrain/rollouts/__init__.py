"""Producing training data: building a trajectory from sampled turns (`builder`), gathering
groups of rollouts (`gather`), tool calls in an assistant's text (`tool_calls`), evaluation and
its prompts (`evaluation`), the job's task rollouts (`task_rollouts`), and chat datasets for SFT
(`sft_data`) and DPO (`dpo_data`).

Nothing is imported here, so that importing one module does not import the others.
"""
