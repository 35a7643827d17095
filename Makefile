# Octo: one entry point for tests and the demo.
#   make test   create .venv, install Octo with its test extra, make sure RabbitMQ
#               answers on 127.0.0.1:5672 and PostgreSQL on 127.0.0.1:5432 (with
#               the test role and database), install Debian's Chromium (the
#               console's browser tests), promtool (from Debian's prometheus
#               package, into .venv/bin: the alert-rule tests) and
#               systemd-analyze (the unit's tests), then ruff, mypy --strict
#               and pytest
#               (pytest-xdist: PYTEST_WORKERS processes, one test file each at a
#               time, files with a slow test first; PYTEST_WORKERS=0 runs the
#               suite in this process).
#   make model  TLC on the model of the worker's and host's promises (docs/model.md);
#               make test runs it bounded to two requests (tests/model), with Java from
#               deploy/ensure-java.sh.
#   make fuzz   atheris on every byte reader, FUZZ_SECONDS each, growing tests/fuzz/corpus
#               (make test replays the corpus and runs each target briefly).
#   make simulate  SCHEDULES deterministic schedules of the real session, journal and
#               host engine over a simulated broker, the worker dying at any I/O
#               boundary (make test runs 2,000 fixed seeds).
#   make mutate single-line mutants of the lines that enforce the promises, each
#               against the tests that guard it (tests/mutation/mutate.py).
#   make test-cluster  three RabbitMQ nodes in network namespaces, a worker and a host
#               under load, a node killed and a node partitioned (tests/cluster,
#               docs/verification.md); root only, not part of make test.
#   make demo   the main job end to end (see README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PACKAGES := octo_common octo_worker octo_host
EXAMPLE  := examples/octo-example-tickets
# The suite mostly waits on the broker, PostgreSQL and subprocesses, so more
# workers than the 2 cores of the project's machines still shorten it.
PYTEST_WORKERS ?= 4

.PHONY: test-cluster test lint typecheck pytest venv rabbitmq postgres chromium tools java model fuzz simulate mutate demo bench clean

test: venv rabbitmq postgres chromium tools java lint typecheck pytest

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(EXAMPLE)/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The example plug-in (its entry point): its tests run with the others.
	$(PY) -m pip install --quiet --no-deps -e $(EXAMPLE)
	touch $@

rabbitmq:
	sh deploy/ensure-rabbitmq.sh

postgres:
	sh deploy/ensure-postgres.sh

chromium:
	sh deploy/ensure-chromium.sh

# The tools some tests run: promtool (alert rules), systemd-analyze (the unit).
tools: venv
	sh deploy/ensure-promtool.sh $(VENV)/bin
	sh deploy/ensure-systemd-analyze.sh

java:
	sh deploy/ensure-java.sh

model: venv java
	$(PY) -m tests.model.tlc --deep

FUZZ_SECONDS ?= 60
fuzz: venv
	$(PY) -m tests.fuzz.run --seconds $(FUZZ_SECONDS)

SCHEDULES ?= 10000
SIM_PROCESSES ?= 2
simulate: venv
	$(PY) -m tests.sim.run --schedules $(SCHEDULES) --processes $(SIM_PROCESSES)

mutate: venv rabbitmq
	$(PY) -m tests.mutation.mutate

lint: venv
	$(VENV)/bin/ruff check $(PACKAGES) tests bench examples
	$(VENV)/bin/ruff format --check $(PACKAGES) tests bench examples

typecheck: venv
	$(VENV)/bin/mypy --strict $(PACKAGES)
	$(VENV)/bin/mypy --strict $(EXAMPLE)/octo_example_tickets examples/host_service.py

pytest: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Not in make test: it needs root and network namespaces, and takes minutes.
# Without root it says so in one line and succeeds. The trap removes whatever
# a killed run left (namespaces, their processes, the bridge); the fixture
# removes its own on every normal exit.
test-cluster: venv
	@if [ "$$(id -u)" != 0 ]; then echo "test-cluster: skipped: needs root (network namespaces)"; exit 0; fi; \
	sh deploy/ensure-cluster-tools.sh && \
	trap '$(PY) -m tests.cluster.netns --clean' EXIT INT TERM; \
	$(PY) -m pytest -q -s -p no:cacheprovider tests/cluster

demo: venv rabbitmq
	$(PY) demo/demo.py

bench: venv rabbitmq
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) bench/frames.py
	$(PY) bench/journal.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
