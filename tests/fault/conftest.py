"""In-process Trainer runs here leave Lightning's process group behind on purpose, as in tests/strategy."""

from tests.strategy.conftest import _release_lightning_process_group  # noqa: F401 - autouse fixture
