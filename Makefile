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

# Two pytest-xdist workers (tests/conftest.py says why and how the tests are split);
# TEST_WORKERS=0 runs them one by one, in one process.
TEST_WORKERS ?= 2

test: install postgres-server alertmanager chromium
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The report store's tests start a throwaway PostgreSQL server from Debian's package (tests/pgserver.py).
# Installed here when missing and apt-get can (CI: Debian, as root); elsewhere those tests skip.
postgres-server:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1 \
	    && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing PostgreSQL for the report store's tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	fi

# tests/test_alertmanager.py starts a real Alertmanager from Debian's package; installed the same way.
alertmanager:
	@if ! command -v prometheus-alertmanager >/dev/null 2>&1 && ! command -v alertmanager >/dev/null 2>&1 \
	    && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Alertmanager for the Alertmanager tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus-alertmanager >/dev/null; \
	fi

# tests/test_html_report.py renders the HTML report in headless Chromium from Debian's package; installed the same way.
chromium:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
	    && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Chromium for the HTML report tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

clean:
	rm -rf $(VENV) .rankwatch *.egg-info kafka/lib
