# The commands of the README (`make demo`, `make test`, `make lint`) do all the set-up themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Development installs every extra ([plan], [sim], [report], [k8s]...) and the test tools ([dev]).
# The CPU build of torch 2.13.0 is installed first and pinned; the package's own range is
# then already satisfied, so pip never pulls a CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-unit test-gpu lint commits scenarios clean browser slurm nftables lease-fs torchft-upstream

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,plan,sim,report,examples,etcd,k8s]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/unbroken demo

# The unit tests in two workers (they start no job: most wait on sockets and timeouts), then the
# rest in two workers too, a file each (each test starts a job of several processes: two jobs
# share the 2 cores, as a busy node would; 391 s against 539 s in one process), torchtitan's
# trainer through a kill -9 among them (make torchft-upstream: 324 MB, about 20 s, the [torchft] extra and
# two unpacked wheels): the whole suite stays under 10 minutes on 2 cores.
test: install browser lease-fs torchft-upstream nftables
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests/unit
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --ignore=tests/unit

# The inner loop of development: tests/unit alone (no job started), in two workers: most unit
# tests wait on sockets and timeouts, not the CPU (62 s on 2 cores; 109 s in one process).
test-unit: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests/unit

# The GPU tests (marked gpu; `make test` skips them where CUDA is absent). On a GPU machine whose
# python3 already holds a CUDA build of torch: `make test-gpu PY=python3` (with PYTHONPATH=$PWD).
test-gpu:
	$(PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu

# The dashboard's browser test needs Debian's chromium: installed here when running as root
# (CI); otherwise that one test is skipped and says why.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium); \
	else echo "chromium is missing and this is not root: the dashboard's browser test will be skipped"; fi

# The lease's tests on real filesystems (tests/integration/test_lease_filesystems.py, `unbroken
# bench lease`) need Debian's dosfstools and fusefat (a FAT image), fuse3 (the fault-injecting FUSE
# layer), and etcd-server (the etcd lease): installed here when running as root (CI); otherwise
# those tests are skipped and say why.
LEASE_FS_TOOLS := mkfs.vfat fusefat fusermount3 etcd
LEASE_FS_PKGS := dosfstools fusefat fuse3 etcd-server
lease-fs:
	@if PATH="$$PATH:/usr/sbin:/sbin" sh -c 'for t in $(LEASE_FS_TOOLS); do command -v $$t || exit 1; done' >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q $(LEASE_FS_PKGS) >/dev/null || (apt-get update -q && apt-get install -y -q $(LEASE_FS_PKGS)); \
	else echo "$(LEASE_FS_PKGS) are missing and this is not root: the lease's filesystem tests will be skipped"; fi

# The box's lossy link (`unbroken bench cluster --scenario lossy_link`) drops packets with nftables
# (`netem` is not built into every kernel): installed here when running as root.
nftables:
	@if PATH="$$PATH:/usr/sbin:/sbin" sh -c 'command -v nft' >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q nftables >/dev/null || (apt-get update -q && apt-get install -y -q nftables); \
	else echo "nftables is missing and this is not root: the lossy-link scenario cannot run"; fi

# The Slurm scenario (`unbroken bench cluster --slurm`) needs Debian's slurm-wlm and munge:
# installed here when running as root (CI); otherwise that scenario is skipped and says why.
slurm:
	@if PATH="$$PATH:/usr/sbin:/sbin" sh -c 'for t in slurmctld slurmd slurmstepd munged sbatch; do command -v $$t || exit 1; done' >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q slurm-wlm munge >/dev/null || (apt-get update -q && apt-get install -y -q slurm-wlm munge); \
	else echo "slurm-wlm/munge are missing and this is not root: the Slurm scenario will be skipped"; fi

lint: install commits
	$(VENV)/bin/ruff format --check unbroken tests examples
	$(VENV)/bin/ruff check unbroken tests examples
	$(VENV)/bin/mypy

# Commit subjects stay under 72 characters (the detail goes in the body), from 0.2.0 on: the
# history before it is kept as it was. Skipped, saying so, outside a git checkout with that history.
SUBJECTS_SINCE := 6825e5a
commits:
	@if git rev-parse -q --verify '$(SUBJECTS_SINCE)^{commit}' >/dev/null 2>&1; then \
		bad=$$(git log --format=%s '$(SUBJECTS_SINCE)..HEAD' | awk 'length($$0) >= 72'); \
		if [ -n "$$bad" ]; then echo "commit subjects of 72 characters or more (put the detail in the body):"; \
			echo "$$bad"; exit 1; fi; \
	else echo "no git history back to $(SUBJECTS_SINCE): the commit-subject check is skipped"; fi

# torchft's own integration tests and torchtitan's torchft glue, run on unbroken's facade
# (tests/integration/test_torchft_upstream.py, test_torchtitan.py): the torchft-nightly and
# torchtitan wheels are downloaded and unpacked, never installed (neither is a dependency of
# unbroken); the [torchft] extra brings what their code imports.
UPSTREAM_WHEELS := torchft-nightly==2026.10.26 torchtitan==0.3.0
UPSTREAM := .cache/upstream
torchft-upstream: install
	$(PY) -m pip install -q -e '.[torchft]'
	test -f $(UPSTREAM)/torchtitan/experiments/torchft/manager.py || { rm -rf $(UPSTREAM) && mkdir -p $(UPSTREAM) && \
		$(PY) -m pip download -q --no-deps -d $(UPSTREAM) $(UPSTREAM_WHEELS) && \
		for w in $(UPSTREAM)/*.whl; do $(PY) -m zipfile -e $$w $(UPSTREAM) || exit 1; done; }

# torchft's train_ddp.py example (its repository's root, in no wheel), pinned by commit and
# SHA-256, for `unbroken bench torchft-ddp`; TORCHFT_REPO=path takes it from a torchft checkout.
TORCHFT_COMMIT := 73dafea422116b2a713542719c8454efe5444c6c
TORCHFT_DDP_SHA256 := cd4406ce2c5dbc8777e4700e32c6016eea317fa48183fc74567751b8636cf8cc
torchft-example: torchft-upstream
	test -f $(UPSTREAM)/train_ddp.py || { \
		if [ -n "$(TORCHFT_REPO)" ]; then git -C "$(TORCHFT_REPO)" show $(TORCHFT_COMMIT):train_ddp.py > $(UPSTREAM)/train_ddp.py.part; \
		else curl -fsSL https://raw.githubusercontent.com/pytorch/torchft/$(TORCHFT_COMMIT)/train_ddp.py -o $(UPSTREAM)/train_ddp.py.part; fi && \
		echo "$(TORCHFT_DDP_SHA256)  $(UPSTREAM)/train_ddp.py.part" | sha256sum -c --quiet && \
		mv $(UPSTREAM)/train_ddp.py.part $(UPSTREAM)/train_ddp.py; }

# The long end-to-end scenarios the suite leaves out (about 5 minutes on 2 cores).
scenarios: install slurm nftables lease-fs torchft-upstream
	$(PY) -m pytest -q -p no:cacheprovider -m scenario

clean:
	rm -rf $(VENV) build *.egg-info
