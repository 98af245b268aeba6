"""Users' own tabular data: one CSV file per device, an optional edge list and shared set D'.

Folder layout (docs/data.md, "Your own data: one CSV per device")::

    DIR/device-0.csv ... DIR/device-<n-1>.csv   one file per device, ids contiguous from 0
    DIR/edges.txt                               optional: the device graph, lines 'i j [weight]'
    DIR/shared.csv                              optional: FedRelax's shared unlabelled set D'
    DIR/dataset.toml                            optional: settings (response, split, ...)

Rules
-----
* Every device file has a header row naming its columns; every other non-blank row holds one
  number per column. One column is the response (``response`` setting, default ``y``); every
  other column is a feature. All devices must have the same set of columns (the order may
  differ). Every cell is a plain decimal number (``12``, ``-0.5``, ``3e-4``; spaces around it
  are ignored); empty cells, ``nan``/``inf``, values beyond float64 and other spellings Python
  would accept (``1_0``, ``0x10``) are errors naming file, line and column.
* Feature order (the model's input columns): ``features`` in ``dataset.toml`` when given (each
  device's columns must then be exactly those plus the response), else every column except the
  response sorted by name. Either way a device knows the order from its own file and settings.
* Each device is read from its own file alone (:func:`load_device`): no other device's file is
  opened, so a machine needs only its own ``device-<id>.csv``. :func:`load_tabular` reads a whole
  folder (and checks that the devices' columns agree).
* ``shared.csv`` has exactly the feature columns (no response column: D' is unlabelled).
* The edge list is parsed by :func:`graphfl.common.graph.read_edge_list` (ids checked against
  the number of devices).
* Split: device ``i`` shuffles its rows with ``numpy.random.default_rng([split_seed, i])`` and
  puts the first ``n_test = clip(⌊test_fraction · n_i + ½⌋, 1, n_i − 1)`` rows of the
  permutation in its test split (``n_test = 0`` when ``test_fraction = 0`` or ``n_i = 1``); the
  rest, in file order, are its training rows.
* Standardisation (``standardize = "device"``, default): device ``i`` centres and scales every
  feature by the mean and standard deviation (``ddof = 0``) of its *training* rows; its test
  rows (and its copy of D', :meth:`DeviceData.transform`) use the same mean/sd. A feature
  constant on a device's training rows is only centred (sd taken as 1, with a warning).
  ``standardize = "none"`` keeps raw values. The response is never transformed.
* ``intercept = true`` appends a column of ones named ``(intercept)`` after standardisation.

Settings come from the function arguments, else ``dataset.toml``, else the defaults of
:class:`TabularSettings`. Every error is a :class:`~graphfl.tasks.base.DataError` naming the file
(and the line and column where there is one); a bad edge list raises
:class:`~graphfl.common.graph.GraphError` naming file and line.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
import tomllib
from array import array
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from graphfl.common.graph import adjacency_from_edges, read_edge_list
from graphfl.tasks.base import ClientData, DataError, Task, TaskSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

DEVICE_FILE = "device-{id}.csv"
EDGES_FILE = "edges.txt"
SHARED_FILE = "shared.csv"
SETTINGS_FILE = "dataset.toml"
INTERCEPT_COLUMN = "(intercept)"
_DEVICE_RE = re.compile(r"^device-(.*)\.csv$")
_STANDARDIZE = ("device", "none")


@dataclass(frozen=True)
class TabularSettings:
    """How a folder of device CSVs is read (keys of ``dataset.toml`` use ``-`` for ``_``).

    Attributes
    ----------
    response
        Name of the response column (default ``"y"``).
    test_fraction
        Share of each device's rows held out for testing, in ``[0, 0.9]`` (default 0.2).
    split_seed
        Seed of the per-device split (default 0): device ``i`` uses ``default_rng([split_seed, i])``.
    standardize
        ``"device"`` (each device's training mean/sd) or ``"none"``.
    intercept
        Append a column of ones after standardisation.
    features
        The feature columns in model order (the schema every device shares); ``()`` = every
        column except the response, sorted by name. A list of names, or one comma-separated
        string, in ``dataset.toml``.
    """

    response: str = "y"
    test_fraction: float = 0.2
    split_seed: int = 0
    standardize: Literal["device", "none"] = "device"
    intercept: bool = False
    features: tuple[str, ...] = ()

    def check(self, source: str) -> TabularSettings:
        """Validate the values; ``source`` names where they came from in the error."""
        if not isinstance(self.response, str) or not self.response.strip():
            raise DataError(f"{source}: response must be a non-empty column name, got {self.response!r}")
        tf = self.test_fraction
        if isinstance(tf, bool) or not isinstance(tf, (int, float)) or not (0.0 <= float(tf) <= 0.9):
            raise DataError(f"{source}: test-fraction must be a number in [0, 0.9], got {tf!r}")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int) or self.split_seed < 0:
            raise DataError(f"{source}: split-seed must be an integer >= 0, got {self.split_seed!r}")
        if self.standardize not in _STANDARDIZE:
            raise DataError(f"{source}: standardize must be one of {list(_STANDARDIZE)}, got {self.standardize!r}")
        if not isinstance(self.intercept, bool):
            raise DataError(f"{source}: intercept must be true or false, got {self.intercept!r}")
        return replace(self, response=self.response.strip(), test_fraction=float(tf),
                       features=_feature_list(source, self.features, self.response.strip()))


def _feature_list(source: str, value: Any, response: str) -> tuple[str, ...]:
    """``features`` as a tuple of distinct, non-empty names without the response."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(c, str) for c in items):
        raise DataError(f"{source}: features must be a list of column names, got {value!r}")
    names = tuple(c.strip() for c in items if c.strip())
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        raise DataError(f"{source}: features names {dup} more than once")
    if response in names:
        raise DataError(f"{source}: features lists the response column {response!r}")
    return names


@dataclass(frozen=True)
class DeviceData:
    """One device's arrays after split and standardisation (float64).

    ``mean``/``scale`` are the training statistics applied to the raw features (0 and 1 with
    ``standardize = "none"``); :meth:`transform` maps raw rows (e.g. of D') the same way.
    """

    device: int
    path: Path
    x_train: FloatArray
    y_train: FloatArray
    x_test: FloatArray
    y_test: FloatArray
    mean: FloatArray
    scale: FloatArray
    intercept: bool = False

    def transform(self, raw: npt.ArrayLike) -> FloatArray:
        """``(raw − mean) / scale`` (plus the column of ones if ``intercept``)."""
        x = np.asarray(raw, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.mean.shape[0]:
            raise ValueError(f"device {self.device}: expected rows with {self.mean.shape[0]} raw features, "
                             f"got shape {x.shape}")
        out: FloatArray = (x - self.mean) / self.scale
        if self.intercept:
            out = np.hstack([out, np.ones((out.shape[0], 1))])
        return out

    def arrays(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """``(X_train, y_train, X_test, y_test)``."""
        return self.x_train, self.y_train, self.x_test, self.y_test


@dataclass(frozen=True)
class TabularDataset:
    """A loaded folder: devices, feature names, graph and D'.

    ``features`` are the columns of every ``X`` (with ``(intercept)`` last when enabled);
    ``adjacency`` is ``None`` without ``edges.txt``; ``shared_raw`` is D' in raw units
    (``None`` without ``shared.csv``) — each device maps it with its own
    :meth:`DeviceData.transform` (:meth:`shared_for`).
    """

    root: Path
    settings: TabularSettings
    features: tuple[str, ...]
    devices: tuple[DeviceData, ...]
    adjacency: FloatArray | None = None
    shared_raw: FloatArray | None = None
    raw_features: tuple[str, ...] = field(default=())

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_features(self) -> int:
        return len(self.features)

    def edges(self) -> list[tuple[int, int]]:
        """Undirected edges ``(i, j)``, ``i < j``, sorted (empty without a graph)."""
        if self.adjacency is None:
            return []
        return [(int(i), int(j)) for i, j in zip(*np.nonzero(np.triu(self.adjacency, 1)))]

    def shared_for(self, device: int) -> FloatArray:
        """D' in device ``device``'s coordinates; raises if the folder has no ``shared.csv``."""
        if self.shared_raw is None:
            raise DataError(f"{self.root / SHARED_FILE} not found: this dataset has no shared set D'")
        return self.devices[device].transform(self.shared_raw)


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def read_settings(root: str | Path) -> dict[str, Any]:
    """The keys present in ``DIR/dataset.toml`` (``{}`` without the file), as field names.

    Raises
    ------
    DataError
        Unparsable TOML or an unknown key (the message names the file and the valid keys).
    """
    path = Path(root) / SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as TOML: {exc}") from None
    valid = {f.name.replace("_", "-"): f.name for f in fields(TabularSettings)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in valid:
            raise DataError(f"{path}: unknown key {key!r}; valid keys: {sorted(valid)}")
        out[valid[key]] = value
    return out


def resolve_settings(root: str | Path, base: dict[str, Any] | None = None, **explicit: Any) -> TabularSettings:
    """Settings for ``root``: ``explicit`` (non-``None``) > ``dataset.toml`` > ``base`` > defaults."""
    merged: dict[str, Any] = dict(base or {})
    merged.update(read_settings(root))
    merged.update({k: v for k, v in explicit.items() if v is not None})
    unknown = set(merged) - {f.name for f in fields(TabularSettings)}
    if unknown:
        raise TypeError(f"unknown tabular settings {sorted(unknown)}")
    return TabularSettings(**merged).check(str(Path(root) / SETTINGS_FILE))


def device_files(root: str | Path) -> list[Path]:
    """``DIR/device-0.csv … device-<n-1>.csv`` in id order.

    Raises
    ------
    DataError
        The folder or ``device-0.csv`` is missing, a ``device-*.csv`` name is not a plain
        non-negative integer id (``device-07.csv``, ``device-a.csv``), or the ids have a gap.
    """
    folder = Path(root)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} not found: give --data-dir DIR (a folder holding "
                        f"{DEVICE_FILE.format(id=0)}, {DEVICE_FILE.format(id=1)}, ...; see docs/data.md)")
    ids: dict[int, Path] = {}
    for path in folder.iterdir():
        m = _DEVICE_RE.match(path.name)
        if not m:
            continue
        token = m.group(1)
        if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
            raise DataError(f"{path}: device files are named device-<id>.csv with id 0, 1, 2, ... "
                            f"(no leading zeros); {token!r} is not such an id")
        ids[int(token)] = path
    if not ids:
        raise DataError(f"{folder / DEVICE_FILE.format(id=0)} not found: a data folder holds one CSV per device, "
                        f"device-0.csv ... device-<n-1>.csv (see docs/data.md)")
    n = max(ids) + 1
    missing = [i for i in range(n) if i not in ids]
    if missing:
        raise DataError(f"{folder / DEVICE_FILE.format(id=missing[0])} not found: device ids must be contiguous "
                        f"0..{n - 1} (missing {missing[:10]})")
    return [ids[i] for i in range(n)]


_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A plain decimal number: optional sign, digits with an optional decimal point, optional
exponent. Python's other spellings (``1_0``, ``nan``, ``inf``, ``0x1p3``, non-ASCII digits) are not."""


def _parse_number(path: Path, line: int, column: str, cell: str) -> float:
    """The value of one cell: a plain decimal number (:data:`_NUMBER_RE`), spaces around it ignored.

    Raises
    ------
    DataError
        An empty cell, anything else than a plain decimal number (naming ``nan``/``inf``), or a
        number too large for a float64; the message names file, line and column.
    """
    text = cell.strip(" \t")
    if not text:
        raise DataError(f"{path}:{line}: column {column!r} is empty (every cell needs a number)")
    if not _NUMBER_RE.fullmatch(text):
        if text.lstrip("+-").lower() in ("nan", "inf", "infinity"):
            raise DataError(f"{path}:{line}: column {column!r} has {cell!r}; NaN and infinite values are not allowed")
        raise DataError(f"{path}:{line}: column {column!r} has {cell!r}, which is not a number "
                        f"(plain decimal numbers only, such as 12, -0.5 or 3e-4)")
    value = float(text)
    if not math.isfinite(value):
        raise DataError(f"{path}:{line}: column {column!r} has {cell!r}, which is beyond the range of a float64 "
                        f"(about 1.8e308)")
    return value


def read_numeric_csv(path: str | Path) -> tuple[tuple[str, ...], FloatArray]:
    """Header and values of a numeric CSV (comma separated, UTF-8, optional BOM).

    Blank lines are skipped; line numbers in errors are the file's physical lines. Values are
    collected in one flat float64 buffer (8 bytes a cell while reading).

    Raises
    ------
    DataError
        Missing/unreadable file, no header, an empty or duplicate column name, a row with the
        wrong number of cells, an empty, non-numeric or non-finite cell, or no data rows.
    """
    header, values = _read_csv(Path(path), header_only=False)
    return header, values


def read_header(path: str | Path) -> tuple[str, ...]:
    """The column names of a CSV: its first non-blank line only (no data row is read).

    Raises
    ------
    DataError
        As :func:`read_numeric_csv` for the header (missing file, empty, an unnamed or repeated column).
    """
    return _read_csv(Path(path), header_only=True)[0]


def _read_csv(p: Path, header_only: bool) -> tuple[tuple[str, ...], FloatArray]:
    if not p.is_file():
        raise DataError(f"{p} not found")
    flat = array("d")
    n_rows = 0
    header: list[str] | None = None
    try:
        with p.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            for cells in reader:
                if not cells or all(not c.strip() for c in cells):
                    continue
                if header is None:
                    header = [c.strip() for c in cells]
                    for k, name in enumerate(header):
                        if not name:
                            raise DataError(f"{p}:{reader.line_num}: header column {k + 1} has no name")
                        if name in header[:k]:
                            raise DataError(f"{p}:{reader.line_num}: column {name!r} appears twice in the header")
                    if header_only:
                        break
                    continue
                if len(cells) != len(header):
                    raise DataError(f"{p}:{reader.line_num}: expected {len(header)} cells (one per header column), "
                                    f"got {len(cells)}")
                flat.extend([_parse_number(p, reader.line_num, name, c) for name, c in zip(header, cells)])
                n_rows += 1
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise DataError(f"{p}: malformed CSV: {exc}") from None
    except OSError as exc:
        raise DataError(f"{p}: cannot be read: {exc}") from None
    if header is None:
        raise DataError(f"{p}: the file is empty; it needs a header row naming the columns")
    if header_only:
        return tuple(header), np.zeros((0, len(header)))
    if not n_rows:
        raise DataError(f"{p}: no data rows after the header (every device needs at least one row)")
    values: FloatArray = np.frombuffer(flat, dtype=np.float64).reshape(n_rows, len(header))
    return tuple(header), values


def _check_columns(path: Path, header: tuple[str, ...], expected: set[str], reference: str) -> None:
    got = set(header)
    if got != expected:
        missing = sorted(expected - got)
        extra = sorted(got - expected)
        raise DataError(f"{path}: columns differ from {reference}: missing {missing}, extra {extra} "
                        f"(every device needs the same columns)")


def split_rows(n_rows: int, test_fraction: float, split_seed: int, device: int) -> tuple[npt.NDArray[np.int64],
                                                                                        npt.NDArray[np.int64]]:
    """Training and test row indices (each sorted) of one device (rule in the module docstring)."""
    if n_rows < 1:
        raise ValueError(f"n_rows must be >= 1, got {n_rows}")
    n_test = 0
    if test_fraction > 0 and n_rows >= 2:
        n_test = int(min(max(math.floor(test_fraction * n_rows + 0.5), 1), n_rows - 1))
    perm = np.random.default_rng([split_seed, device]).permutation(n_rows)
    return np.sort(perm[n_test:]).astype(np.int64), np.sort(perm[:n_test]).astype(np.int64)


def _standardiser(path: Path, x_train: FloatArray, names: tuple[str, ...], mode: str) -> tuple[FloatArray, FloatArray]:
    p = x_train.shape[1]
    if mode == "none":
        return np.zeros(p), np.ones(p)
    with np.errstate(over="ignore", invalid="ignore"):
        mean = x_train.mean(axis=0)
        sd = x_train.std(axis=0)
        big = ~(np.isfinite(mean) & np.isfinite(sd))
        if np.any(big):  # squares (or sums) of values near float64's limit overflow: scale the columns first
            top = np.max(np.abs(x_train[:, big]), axis=0)
            mean[big] = top * (x_train[:, big] / top).mean(axis=0)
            sd[big] = top * (x_train[:, big] / top).std(axis=0)
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(sd))):
        bad = [names[k] for k in np.flatnonzero(~(np.isfinite(mean) & np.isfinite(sd)))]
        raise DataError(f"{path}: feature(s) {bad} cannot be standardised: their mean or standard deviation "
                        f"overflows float64; rescale them")
    flat = sd <= 1e-12 * np.maximum(1.0, np.abs(mean))
    if np.any(flat):
        logger.warning("%s: feature(s) %s are constant on the training rows; centred only (sd taken as 1)",
                       path, [names[k] for k in np.flatnonzero(flat)])
        sd = np.where(flat, 1.0, sd)
    return mean, sd


def feature_order(path: Path, header: tuple[str, ...], settings: TabularSettings) -> tuple[str, ...]:
    """The raw feature columns of a file with ``header``, in model order.

    ``settings.features`` when given (the file must then have exactly those columns plus the
    response); otherwise every column except the response, sorted by name, so that devices
    agree on the order whatever order their files list the columns in.

    Raises
    ------
    DataError
        No response column, no feature column, or columns other than ``settings.features``.
    """
    if settings.response not in header:
        raise DataError(f"{path}: no response column {settings.response!r} in the header {list(header)} "
                        f"(set 'response' in {SETTINGS_FILE} or pass response=...)")
    if settings.features:
        _check_columns(path, header, {*settings.features, settings.response},
                       f"the feature list {list(settings.features)} (features)")
        return settings.features
    raw = tuple(sorted(c for c in header if c != settings.response))
    if not raw:
        raise DataError(f"{path}: no feature columns besides the response {settings.response!r}")
    return raw


def _device(path: Path, device: int, header: tuple[str, ...], values: FloatArray, raw: tuple[str, ...],
            settings: TabularSettings) -> DeviceData:
    """Split and standardise one device's rows (module docstring)."""
    col = {name: k for k, name in enumerate(header)}
    x = values[:, [col[c] for c in raw]]
    y = values[:, col[settings.response]]
    tr, te = split_rows(len(y), settings.test_fraction, settings.split_seed, device)
    if len(te) == 0 and settings.test_fraction > 0:
        logger.warning("%s: only %d row(s); no test rows for this device", path, len(y))
    mean, scale = _standardiser(path, x[tr], raw, settings.standardize)
    proto = DeviceData(device, path, x[tr], y[tr], x[te], y[te], mean, scale, settings.intercept)
    return replace(proto, x_train=proto.transform(x[tr]), x_test=proto.transform(x[te]))


def _shared(folder: Path, settings: TabularSettings, raw: tuple[str, ...]) -> FloatArray | None:
    """D' (``shared.csv``) in raw units, columns in ``raw`` order; ``None`` without the file."""
    shared_path = folder / SHARED_FILE
    if not shared_path.is_file():
        return None
    header, values = read_numeric_csv(shared_path)
    if settings.response in header:
        raise DataError(f"{shared_path}: has the response column {settings.response!r}; the shared set D' "
                        f"is unlabelled, so give only the feature columns {list(raw)}")
    _check_columns(shared_path, header, set(raw), f"the devices' feature columns {sorted(raw)}")
    col = {name: k for k, name in enumerate(header)}
    out: FloatArray = values[:, [col[c] for c in raw]]
    return out


def device_path(source: str | Path, device: int) -> Path:
    """The CSV of ``device``: ``source`` itself if it is a file, else ``source/device-<device>.csv``."""
    p = Path(source)
    return p if p.is_file() else p / DEVICE_FILE.format(id=device)


def load_device(
    source: str | Path,
    device: int,
    *,
    features: tuple[str, ...] | list[str] = (),
    with_shared: bool = True,
    base: dict[str, Any] | None = None,
    **explicit: Any,
) -> tuple[DeviceData, FloatArray | None, tuple[str, ...]]:
    """One device's data from its own file alone (no other device's file is opened).

    Parameters
    ----------
    source
        The device's CSV, or the folder holding ``device-<device>.csv``. ``dataset.toml`` and
        ``shared.csv`` are read from the file's folder.
    device
        The device id (it seeds the split).
    features
        The feature columns in model order (overrides ``dataset.toml``'s ``features``; ``()`` =
        the file's settings, else the sorted columns, :func:`feature_order`).
    with_shared
        Read ``shared.csv`` when present (FedRelax's D'); ``False`` skips it.
    base, explicit
        Settings as in :func:`resolve_settings` (``explicit`` keys: ``response``,
        ``test_fraction``, ``split_seed``, ``standardize``, ``intercept``).

    Returns
    -------
    ``(DeviceData, D' in raw units or None, feature names)`` — for a device of a folder, the same
    arrays as :func:`load_tabular` gives (names include ``(intercept)`` when enabled).

    Raises
    ------
    DataError
        The device's file is missing or malformed, or its columns differ from ``features``.
    """
    f = device_path(source, device)
    if not f.is_file():
        raise DataError(f"{f} not found: device {device} needs its own CSV (a folder holding "
                        f"{DEVICE_FILE.format(id=device)}, or the file itself; see docs/data.md)")
    settings = resolve_settings(f.parent, base, **explicit)
    if features:
        settings = replace(settings, features=_feature_list("features", tuple(features), settings.response))
    header, values = read_numeric_csv(f)
    raw = feature_order(f, header, settings)
    dev = _device(f, device, header, values, raw, settings)
    shared = _shared(f.parent, settings, raw) if with_shared else None
    return dev, shared, raw + ((INTERCEPT_COLUMN,) if settings.intercept else ())


def load_tabular(
    root: str | Path,
    *,
    response: str | None = None,
    test_fraction: float | None = None,
    split_seed: int | None = None,
    standardize: Literal["device", "none"] | None = None,
    intercept: bool | None = None,
    base: dict[str, Any] | None = None,
) -> TabularDataset:
    """Read a whole folder of device CSVs (module docstring): split, standardise, graph and D'.

    For a process that holds every device's data (the p2p in-process engine, analyses); a client
    uses :func:`load_device`, which gives the same arrays for its device from its own file.

    Parameters
    ----------
    root
        The folder holding ``device-<id>.csv``.
    response, test_fraction, split_seed, standardize, intercept
        Override ``dataset.toml`` (``None`` = take the file's value, else the default).
    base
        Defaults that ``dataset.toml`` overrides (used by the ``csv`` task for its run seed).

    Raises
    ------
    DataError
        Any malformed file, naming the file (and line/column).
    graphfl.common.graph.GraphError
        A malformed ``edges.txt`` or an edge naming an unknown device (file and line).
    """
    folder = Path(root)
    files = device_files(folder)
    settings = resolve_settings(folder, base, response=response, test_fraction=test_fraction,
                                split_seed=split_seed, standardize=standardize, intercept=intercept)
    first_header: tuple[str, ...] | None = None
    raw_features: tuple[str, ...] = ()
    devices: list[DeviceData] = []
    for dev, path in enumerate(files):
        header, values = read_numeric_csv(path)
        if first_header is not None and settings.response in header and not settings.features:
            _check_columns(path, header, set(first_header), files[0].name)
        raw = feature_order(path, header, settings)
        if first_header is None:
            first_header, raw_features = header, raw
        devices.append(_device(path, dev, header, values, raw, settings))
    assert first_header is not None
    adjacency: FloatArray | None = None
    edges_path = folder / EDGES_FILE
    if edges_path.exists():
        adjacency = adjacency_from_edges(len(files), read_edge_list(edges_path, len(files)).edges)
    shared = _shared(folder, settings, raw_features)
    features = raw_features + ((INTERCEPT_COLUMN,) if settings.intercept else ())
    logger.info("loaded %d devices from %s: %d features, response %r, %d edges, D' %s", len(devices), folder,
                len(features), settings.response, 0 if adjacency is None else int(np.count_nonzero(adjacency) // 2),
                "absent" if shared is None else f"{shared.shape[0]} rows")
    return TabularDataset(folder, settings, features, tuple(devices), adjacency, shared, raw_features)


def device_arrays(root: str | Path, **settings: Any) -> list[tuple[FloatArray, FloatArray, FloatArray, FloatArray]]:
    """Per-device ``(X_train, y_train, X_test, y_test)`` of :func:`load_tabular` (same keywords)."""
    return [d.arrays() for d in load_tabular(root, **settings).devices]


# ---------------------------------------------------------------------------------------------
# the graphfl task
# ---------------------------------------------------------------------------------------------


def device_ids(folder: Path) -> dict[int, Path]:
    """The ``device-<id>.csv`` files present in ``folder`` by id (names only: no file is opened)."""
    out: dict[int, Path] = {}
    if not folder.is_dir():
        return out
    for path in folder.iterdir():
        m = _DEVICE_RE.match(path.name)
        if m and m.group(1).isdigit() and (len(m.group(1)) == 1 or not m.group(1).startswith("0")):
            out[int(m.group(1))] = path
    return out


def _file_stamp(*paths: Path) -> tuple[tuple[str, int, int] | None, ...]:
    """Size and mtime of each path (``None`` when absent): a cache key that reloads an edited file."""
    out: list[tuple[str, int, int] | None] = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            out.append(None)
            continue
        out.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@lru_cache(maxsize=4)
def _device_cached(folder: str, device: int, stamp: tuple[tuple[str, int, int] | None, ...],
                   base: tuple[tuple[str, Any], ...], explicit: tuple[tuple[str, Any], ...]) -> tuple[DeviceData,
                                                                                                   tuple[str, ...]]:
    del stamp  # part of the key only
    dev, _, names = load_device(Path(folder), device, with_shared=False, base=dict(base),
                                **{k: v for k, v in explicit if v is not None})
    return dev, names


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _float32(dev: DeviceData, names: tuple[str, ...], values: FloatArray) -> npt.NDArray[np.float32]:
    """``values`` as float32 (the dtype the task's model trains in).

    Raises
    ------
    DataError
        A value beyond float32's range (about 3.4e38), which would become infinite: naming the
        device's file, the column (after standardisation for features) and the value.
    """
    too_big = np.abs(values) > FLOAT32_MAX
    if np.any(too_big):
        row, col = (int(k) for k in np.argwhere(too_big)[0])
        raise DataError(f"{dev.path}: column {names[col]!r} has the value {values[row, col]:.6g}, beyond the "
                        f"range of float32 (about 3.4e38), in which task csv trains; rescale the column")
    out: npt.NDArray[np.float32] = values.astype(np.float32)
    return out


class CSVTask(Task):
    """Task ``csv``: the folder ``--data-dir`` (else ``$GRAPHFL_DATA``) of device CSVs.

    Client ``i`` is device ``i`` and reads only ``device-<i>.csv`` (plus ``dataset.toml`` and
    ``edges.txt``) from its folder, so a machine needs no other device's file
    (:func:`load_device`). Regression with a linear model (``torch.nn.Linear(features, 1)``)
    and MSE. The client graph is ``edges.txt`` when present. Test fraction and split seed
    default to the run's ``data.test-fraction`` and ``seed``; ``dataset.toml`` and keyword
    options override them.

    The model's input size (:meth:`feature_names`) comes from, in order: the client's own loaded
    file; ``features`` in ``dataset.toml``; the headers (first lines only) of the device files the
    folder holds, which must agree. A server holds no device rows: its folder needs
    ``dataset.toml`` with ``features``, or device files whose headers it reads.
    """

    spec = TaskSpec("csv", "regression", default_nodes=4, needs_data_dir=True,
                    summary="your data: DIR/device-<id>.csv (+ edges.txt, shared.csv), linear regression")

    def __init__(self, *args: Any, response: str | None = None, standardize: str | None = None,
                 intercept: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._explicit = tuple(sorted({"response": response, "standardize": standardize,
                                       "intercept": intercept}.items()))
        self._own_features: tuple[str, ...] | None = None

    def folder(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir)
        env = os.environ.get("GRAPHFL_DATA")
        if env:
            return Path(env)
        raise DataError("task csv needs a data folder: give --data-dir DIR (a folder holding device-0.csv, "
                        "device-1.csv, ...; see docs/data.md) or set $GRAPHFL_DATA")

    def _options(self) -> dict[str, Any]:
        """The task's keyword options that were given (they override ``dataset.toml``)."""
        return {k: v for k, v in self._explicit if v is not None}

    def _base(self) -> tuple[tuple[str, Any], ...]:
        return (("split_seed", self.seed), ("test_fraction", float(self.data.test_fraction)))

    def settings(self) -> TabularSettings:
        """The folder's settings (``dataset.toml`` over the run's seed and test fraction)."""
        return resolve_settings(self.folder(), dict(self._base()), **self._options())

    def _check_folder(self, folder: Path, num_partitions: int) -> None:
        if not folder.is_dir():
            raise DataError(f"data folder {folder} not found: give --data-dir DIR (a folder holding "
                            f"{DEVICE_FILE.format(id=0)}, {DEVICE_FILE.format(id=1)}, ...; see docs/data.md)")
        beyond = sorted(i for i in device_ids(folder) if i >= num_partitions)
        if beyond:
            raise DataError(f"{folder} holds {DEVICE_FILE.format(id=beyond[-1])} but the run has {num_partitions} "
                            f"clients (devices 0..{num_partitions - 1}); use --nodes {beyond[-1] + 1}")

    def dataset(self) -> TabularDataset:
        """The whole folder (every device file): for analyses on a machine that holds them all."""
        return load_tabular(self.folder(), base=dict(self._base()), **self._options())

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        """Device ``partition_id``'s split, read from ``device-<partition_id>.csv`` alone (cached
        until that file or ``dataset.toml`` changes).
        """
        self.check_num_partitions(num_partitions)
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
        folder = self.folder()
        self._check_folder(folder, num_partitions)
        own = folder / DEVICE_FILE.format(id=partition_id)
        d, names = _device_cached(str(folder), partition_id, _file_stamp(own, folder / SETTINGS_FILE),
                                  self._base(), self._explicit)
        self._own_features = names
        resp = (self.settings().response,)
        return ClientData(_float32(d, names, d.x_train), _float32(d, resp, d.y_train[:, None]),
                          _float32(d, names, d.x_test), _float32(d, resp, d.y_test[:, None]))

    def feature_names(self) -> tuple[str, ...]:
        """The model's input columns (with ``(intercept)`` when enabled); see the class docstring.

        Raises
        ------
        DataError
            The folder has neither ``features`` in ``dataset.toml`` nor a device file, or the
            device files' headers name different columns (naming both files).
        """
        if self._own_features is not None:
            return self._own_features
        folder = self.folder()
        settings = self.settings()
        tail = (INTERCEPT_COLUMN,) if settings.intercept else ()
        if settings.features:
            return settings.features + tail
        present = sorted(device_ids(folder).items())
        if not present:
            raise DataError(f"task csv: {folder} holds neither {SETTINGS_FILE} with 'features' nor a device file, so "
                            f"the model's input columns are unknown; put features = [\"col1\", \"col2\", ...] "
                            f"in {folder / SETTINGS_FILE} (see docs/data.md)")
        raw: tuple[str, ...] | None = None
        first: Path | None = None
        for _, path in present:
            header = read_header(path)
            if first is not None:
                _check_columns(path, header, {*(raw or ()), settings.response}, first.name)
            names = feature_order(path, header, settings)
            if raw is None:
                raw, first = names, path
        assert raw is not None
        return raw + tail

    def client_graph(self, num_partitions: int) -> np.ndarray | None:
        """``edges.txt`` of the folder (ids checked against ``num_partitions``), else ``None``."""
        folder = self.folder()
        path = folder / EDGES_FILE
        if not path.is_file():
            return None
        self._check_folder(folder, num_partitions)
        return adjacency_from_edges(num_partitions, read_edge_list(path, num_partitions).edges)

    def build_model(self) -> torch.nn.Module:
        import torch

        from graphfl.tasks.models import seeded

        return seeded(self.seed, torch.nn.Linear, len(self.feature_names()), 1)
