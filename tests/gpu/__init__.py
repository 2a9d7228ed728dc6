"""The GPU path's tests (skipped without CUDA; tools/gpu_check.sh runs them, on CPU in its dry run).
A package, so that pytest imports this folder's conftest.py as `gpu.conftest`: as a bare `conftest`
it would replace tests/conftest.py in `sys.modules`, and every later `from conftest import ...`
(tests/unit, tests/e2e, tests/distributed) would find this one."""
