"""Task names -> task classes. ``create(name, ...)`` is the only way code builds a task."""

from __future__ import annotations

from graphfl.common.config import ConfigError, DataConfig
from graphfl.tasks.base import Task
from graphfl.tasks.ciao import Ciao
from graphfl.tasks.labeled import CIFAR10, MNIST, CIFAR10ResNet18, Digits, PermutedDigits
from graphfl.tasks.molecules import BBBP
from graphfl.tasks.synthetic import MULTICENTER_TASKS, SyntheticDFL, SyntheticVector
from graphfl.tasks.tabular import CSVTask

_TASKS: dict[str, type[Task]] = {
    cls.spec.name: cls for cls in (Digits, PermutedDigits, MNIST, CIFAR10, CIFAR10ResNet18, SyntheticDFL,
                                *MULTICENTER_TASKS, CSVTask, BBBP, Ciao, SyntheticVector)
}


def register_task(cls: type[Task]) -> type[Task]:
    """Add a task class (usable as a decorator); its ``spec.name`` must be new."""
    name = cls.spec.name
    if name in _TASKS and _TASKS[name] is not cls:
        raise ValueError(f"task {name!r} is already registered")
    _TASKS[name] = cls
    return cls


def names() -> list[str]:
    """Names of all registered tasks, sorted."""
    return sorted(_TASKS)


def get(name: str) -> type[Task]:
    """The task class called ``name``; an unknown name is a ConfigError listing the valid ones."""
    try:
        return _TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; valid tasks: {names()}") from None


def create(name: str, data: DataConfig | None = None, data_dir: str = "", seed: int = 0, **kwargs) -> Task:
    """Instantiate task ``name`` (extra keyword options go to the task class)."""
    return get(name)(data=data, data_dir=data_dir, seed=seed, **kwargs)
