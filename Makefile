# Two commands on a fresh machine:  `make demo`  and  `make test`.  Both install what they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement can pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test install clean

$(BIN)/rankwatch: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

install: $(BIN)/rankwatch

demo: install
	$(BIN)/rankwatch demo

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .rankwatch *.egg-info
