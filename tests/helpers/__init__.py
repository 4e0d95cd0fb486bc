"""What the tests share: the policy model (model), the simulated CUDA runtime
and the fixtures that serve it (fake_cuda), and where the repository is."""
import pathlib

#: The repository's root (README, pyproject.toml, benchmarks/).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
