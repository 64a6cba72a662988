# fastft: `make demo` runs the demo, `make test` the tests (CI runs it), `make bench` the benchmarks.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt

.PHONY: scale-model test test-slow test-net test-exhaustive test-store-vote test-jax test-ray test-lightning test-hf test-floor conformance unit lint bench bench-jax bench-ray bench-quick demo demo-jax fsm-doc flags-doc clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

# torch first, pinned by constraints.txt (the CPU build of 2.13.0 is available offline;
# any other version pulls gigabytes of CUDA packages), then the package with its dev,
# torchft and nats extras (the torchft integration's and the NATS control plane's tests run
# in CI).
$(VENV)/.installed: $(BIN)/activate pyproject.toml constraints.txt
	@echo "fastft: installing torch 2.13.0 (the CPU build) into $(VENV): a few minutes the first time"
	$(PIP) torch==2.13.0
	@echo "fastft: installing fastft and its extras (test tools, torchft, NATS, Prometheus, matplotlib)"
	$(PIP) -e '.[dev,torchft,nats,metrics,plot]'
	# bytecode for the editable source: where PYTHONDONTWRITEBYTECODE is set (as on the
	# machine this was built on) every worker would otherwise compile fastft's modules
	# again at start-up (~30 ms of a restart)
	$(BIN)/python -m compileall -q src
	touch $@

# JAX (the `jax` extra: ~100 MB) only for the targets that need it
$(VENV)/.jax: $(VENV)/.installed
	@echo "fastft: installing the jax extra (jax 0.10.2, optax)"
	$(PIP) -e '.[jax]'
	touch $@

# make test: every tier but the slowest scenarios and JAX's (under 10 minutes on 2 cores);
# make test-slow: those (CI runs both, test-store-vote, test-jax and the torchft
# conformance run).
test: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q -m "not slow and not net" tests --ignore=tests/jax --ignore=tests/ray --ignore=tests/lightning --ignore=tests/hf

test-slow: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q -m "slow and not exhaustive and not net" tests --ignore=tests/jax --ignore=tests/ray --ignore=tests/lightning --ignore=tests/hf

# real network faults: nodes in network namespaces whose links are cut, flapped,
# throttled (root: ip netns, veth, tc; skipped, saying why, elsewhere)
test-net: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q -m net tests/net

# the simulator's 3-member world with a fault, every interleaving (17-18 min on 2 cores:
# run by hand after a protocol change; CI's budget has no room for it)
test-exhaustive: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m exhaustive tests/sim

# fastft.jax: its parts in process, and the fault catalogue against the JAX demo (~2 min)
test-jax: $(VENV)/.jax
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q tests/jax

# Ray (the `ray` extra) only for the targets that need it
$(VENV)/.ray: $(VENV)/.installed
	@echo "fastft: installing the ray extra (ray 2.60.0)"
	$(PIP) -e '.[ray]'
	touch $@

# fastft ray run on a local two-node Ray cluster the tests start and stop
test-ray: $(VENV)/.ray
	TORCH_CPP_LOG_LEVEL=ERROR RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest -q tests/ray

# PyTorch Lightning (the `lightning` extra) only for the targets that need it
$(VENV)/.lightning: $(VENV)/.installed
	@echo "fastft: installing the lightning extra (pytorch-lightning 2.6)"
	$(PIP) -e '.[lightning]'
	touch $@

# fastft.lightning's FastFTStrategy: an ordinary LightningModule under fastft run and
# fault plans, bitwise against its fault-free run (~1.5 minutes)
test-lightning: $(VENV)/.lightning
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q tests/lightning

# Hugging Face (the `hf` extra: transformers, accelerate) only for the targets that need it
$(VENV)/.hf: $(VENV)/.installed
	@echo "fastft: installing the hf extra (transformers 5, accelerate 1)"
	$(PIP) -e '.[hf]'
	touch $@

# fastft.hf's Trainer: a GPT-2 under transformers.Trainer, fastft run and fault plans,
# bitwise against its fault-free run (~1 minute)
test-hf: $(VENV)/.hf
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q tests/hf

# the floors of the jax and ray extras' version ranges (jax 0.10.0, ray 2.58.0; CI tests
# the newest, 0.10.2 and 2.60.0) in a venv of their own: fastft.jax's parts, its restarts,
# and the Ray Trainer tier (~6 minutes; by hand, not in CI's budget)
FLOOR := .venv-floor
test-floor:
	test -x $(FLOOR)/bin/python || $(PY) -m venv $(FLOOR)
	$(FLOOR)/bin/pip install -q -c constraints.txt torch==2.13.0
	$(FLOOR)/bin/pip install -q -c constraints.txt jax==0.10.0 jaxlib==0.10.0 'ray[default]==2.58.0' -e '.[dev,nats,jax,ray]'
	TORCH_CPP_LOG_LEVEL=ERROR RAY_USAGE_STATS_ENABLED=0 $(FLOOR)/bin/python -m pytest -q tests/jax/test_jax_state.py tests/jax/test_jax_restart.py tests/ray/test_ray_trainer.py

# the fault tier (not the slow part) with every step decided by the store's vote
# (--decide store: DESIGN's S2 as written; make test's steps are decided by the vote
# their gradients' allreduce carries, what --decide auto picks: docs/architecture.md),
# and every node's workers hearing the bus through their agent (--bus-relay on, what
# auto picks from 64 workers); about 3 minutes here, in CI
test-store-vote: $(VENV)/.installed
	FASTFT_DECIDE=store FASTFT_BUS_RELAY=on TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python -m pytest -q -m "not slow and not net" tests/fault

# torchft's own test files (shipped in its wheel) with torchft.Manager rebound to ManagerFFT
conformance: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python tests/conformance/run.py

unit: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests/unit

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

bench: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/bus_latency.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/bus_latency.py --backends tcpstore --relay off on \
		--subscribers 8 64 256 --name bus_relay
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/interrupt_latency.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/bus_soak.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/recovery.py --keep-pairs 3
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/torchft_recovery.py
	$(BIN)/python bench/lighthouse_rpc.py
	$(BIN)/python bench/kill_teardown.py
	$(BIN)/python bench/hang_kill.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/checkpoint.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/node_loss.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/hsdp.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/inprocess.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/zygote.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/chaos.py --planned
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/chaos.py --min-replicas 2 --adaptive-hang --name chaos-elastic \
		--kinds exception,sigkill,sigstop,gil_hang,segfault,exit,state_lost
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/chaos.py --ends 100
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/scale.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/first_start.py
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/leases.py
	$(MAKE) scale-model
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/replica_check.py --steps 150
	$(MAKE) bench-jax
	$(MAKE) bench-ray

# the control plane at 1,024 and 16,384 members: the scale model (fastft.sim.scale) beside
# the real servers at 64, 256 and 512 (docs/simulation.md "The scale model"; ~15 min)
scale-model: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/scale_model.py

# JAX on fastft vs JAX's own multi-controller mode (installs the jax extra; ~12 min)
bench-jax: $(VENV)/.jax
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/jaxft.py --trials 3

# a node lost on a Ray cluster: fastft ray run vs the Ray guide's recovery (installs the
# ray extra)
bench-ray: $(VENV)/.ray
	TORCH_CPP_LOG_LEVEL=ERROR RAY_USAGE_STATS_ENABLED=0 $(BIN)/python bench/ray_node_loss.py --trials 5

# the recovery figures in one trial each, the small model only (8 min 22 s here)
bench-quick: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/recovery.py --quick
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/inprocess.py --trials 1
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/python bench/torchft_recovery.py --trials 1 --faults sigkill,exception --steady-pairs 0

demo: $(VENV)/.installed
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/fastft demo

# the same demo, the model in JAX (fastft.jax)
demo-jax: $(VENV)/.jax
	TORCH_CPP_LOG_LEVEL=ERROR $(BIN)/fastft demo --framework jax

fsm-doc: $(VENV)/.installed
	$(BIN)/fastft fsm-doc > docs/fsm.md

# docs/flags.md: every fastft run / fastft ray run flag, from the code (a test compares)
flags-doc: $(VENV)/.installed
	$(BIN)/python -m fastft.cli.flagdoc > docs/flags.md

clean:
	rm -rf $(VENV) $(FLOOR) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
