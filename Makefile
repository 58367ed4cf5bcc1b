# visbatch: every target installs what it needs into .venv first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
BIN     := $(VENV)/bin
# Hub id or folder; MODEL=tiny builds and uses the offline tiny random model.
MODEL   ?= Qwen/Qwen2-VL-2B-Instruct
PROMPT  ?= What is on this page or frame? Answer in one sentence.
TINY    := .visbatch/tiny-model

.PHONY: install run test lint format clean examples

install: $(VENV)/.installed

# torch goes first and pinned: an unpinned torch makes pip download a multi-GB CUDA build.
# 2.14.1 + torchvision 0.29.1 are a matching pair (the Qwen2-VL processors need torchvision).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(TINY): | install
	$(BIN)/visbatch model tiny $(TINY)

ifeq ($(MODEL),tiny)
RUN_MODEL := $(TINY)
run: $(TINY)
else
RUN_MODEL := $(MODEL)
run: install
endif
	$(BIN)/visbatch run examples/invoice.pdf examples/clip.mp4 --model $(RUN_MODEL) --prompt "$(PROMPT)" \
		--prompt "Is there a table or a chart? Answer yes or no." --max-new-tokens 24

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

examples: install
	$(PY) examples/make_examples.py examples

clean:
	rm -rf .visbatch .pytest_cache
