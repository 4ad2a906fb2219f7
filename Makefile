# Two commands on a fresh machine:  `make demo`  and  `make test`.  Both install what they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement can pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: demo test install kafka clean

$(BIN)/rankwatch: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# Apache Kafka's jars (kafka/pom.xml) for `rankwatch up --broker kafka` and the suite's Kafka tests.
# Re-fetched only when the pom changes; without Java or Maven it says so and the Kafka tests are skipped.
KAFKA_JAR := kafka/lib/.fetched

$(KAFKA_JAR): kafka/pom.xml
	@if command -v mvn >/dev/null && command -v java >/dev/null; then \
		rm -rf kafka/lib && mvn -q -f kafka/pom.xml dependency:copy-dependencies && touch $@; \
	else echo "no java and/or mvn: Apache Kafka is not fetched (Tansu only; its tests are skipped)"; fi

kafka: $(KAFKA_JAR)

install: $(BIN)/rankwatch $(KAFKA_JAR)

demo: install
	$(BIN)/rankwatch demo

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .rankwatch *.egg-info kafka/lib
