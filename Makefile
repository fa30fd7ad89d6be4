# One command from a fresh clone:  make test
# creates .venv, installs tformer with its dev extras (torch pinned by constraints.txt) and runs the tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test install clean train

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
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

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
