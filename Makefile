# Each target sets up .venv when needed, so a fresh clone needs one command.
.PHONY: setup demo demo-real demo-gemma test lint typecheck bench

setup: .venv/.installed

.venv/.installed: pyproject.toml constraints.txt scripts/setup.sh scripts/install-torch.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	.venv/bin/python -m posttrain.cli.main demo

# RL on a real pretrained model, SmolLM2-135M-Instruct (docs/real-models.md).
demo-real: setup
	.venv/bin/python -m posttrain.cli.main demo word-problems

demo-gemma: setup
	.venv/bin/python -m posttrain.cli.main demo gemma3-word-problems

# pytest's worksteal: an idle worker takes queued tests from the busy one, so a 3-minute test
# near the end does not leave the other core idle (the slow suite is most of CI's 35 minutes).
test: setup
	.venv/bin/python -m ruff check src tests benchmarks recipes
	.venv/bin/python -m pyright
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -n 2 --dist worksteal -q --durations=25

lint: setup
	.venv/bin/python -m ruff check src tests benchmarks recipes

typecheck: setup
	.venv/bin/python -m pyright
