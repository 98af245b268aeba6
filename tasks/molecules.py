"""Task ``bbbp``: blood–brain barrier penetration, molecular graph classification (seed 004, ALGORITHMS.md §9.3).

Data: ``<data>/bbbp/BBBP.csv`` (MoleculeNet; columns ``num, name, p_np, smiles``). Each SMILES
becomes a graph with PyG's featurisation (``torch_geometric.utils.from_rdmol``: 9 integer atom
features, bonds as two directed edges). RDKit parses the SMILES first; a molecule it rejects is
logged with its CSV row and skipped, and :meth:`BBBP.describe` counts them.

Split (``data.split``): ``scaffold`` (default) sorts the Bemis–Murcko scaffold groups by size,
largest first, and fills the training set up to ``1 − data.test-fraction`` of the molecules; the
remaining groups are the test set, so no test scaffold occurs in training (Wu et al. 2018,
MoleculeNet). ``random`` splits each client's molecules at random. Clients: a Dirichlet(α =
``data.dirichlet-alpha``) label partition of all molecules (ALGORITHMS.md §1.3); a client's test
set is its share of the scaffold test set. Model: :class:`~graphfl.tasks.gnn_models.MoleculeNet`;
metric ROC-AUC of the class-1 probability (``test_auc``, ``nan`` on a client whose test set has
one class).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.tasks.base import ClientData, DataError, Task, TaskSpec
from graphfl.tasks.partition import client_rng, dirichlet_partition, train_test_split

logger = logging.getLogger(__name__)

SMILES_COLUMN = "smiles"
LABEL_COLUMN = "p_np"


@dataclass(frozen=True)
class MoleculeSet:
    """Parsed molecules of one CSV: graphs, labels, scaffolds, and the rows that were skipped.

    ``rows[k]`` is the 1-based CSV line of molecule ``k`` (the header is line 1).
    """

    graphs: tuple[Any, ...]
    labels: np.ndarray
    scaffolds: tuple[str, ...]
    rows: np.ndarray
    skipped: tuple[tuple[int, str], ...]


def parse_smiles(smiles: str) -> Any | None:
    """The RDKit molecule of ``smiles``, or ``None`` when RDKit rejects it (its stderr message silenced)."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")  # type: ignore[attr-defined]  # RDKit prints parse errors on stderr; callers log them with the row
    try:
        return Chem.MolFromSmiles(smiles)
    finally:
        RDLogger.EnableLog("rdApp.*")  # type: ignore[attr-defined]


def smiles_graph(smiles: str) -> Any | None:
    """The PyG ``Data`` graph of ``smiles`` (``torch_geometric.utils.from_rdmol``: nodes are heavy
    atoms with 9 integer features, each bond two directed edges), or ``None`` when RDKit cannot parse it.
    """
    mol = parse_smiles(smiles)
    return None if mol is None else _graph(mol, smiles)


def _graph(mol: Any, smiles: str) -> Any:
    from torch_geometric.utils import from_rdmol

    data = from_rdmol(mol)
    data.smiles = smiles
    return data


def murcko_scaffold(mol: Any) -> str:
    """Canonical SMILES of the Bemis–Murcko scaffold of an RDKit molecule (``""`` for acyclic ones)."""
    from rdkit.Chem.Scaffolds import MurckoScaffold

    return str(MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False))


def read_molecules(path: Path, smiles_column: str = SMILES_COLUMN, label_column: str = LABEL_COLUMN) -> MoleculeSet:
    """Parse every row of a MoleculeNet-style CSV; unparsable SMILES are logged and skipped.

    Raises
    ------
    DataError
        Missing file or column, a label that is not 0/1 (naming the row), or no parsable molecule.
    """
    if not path.is_file():
        raise DataError(f"bbbp: missing file {path}. Put BBBP.csv under <data-dir>/bbbp/ (see docs/data.md); "
                        "graphfl never downloads data at run time.")
    graphs: list[Any] = []
    labels: list[int] = []
    scaffolds: list[str] = []
    rows: list[int] = []
    skipped: list[tuple[int, str]] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in (smiles_column, label_column) if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; the header has {reader.fieldnames}")
        for line, rec in enumerate(reader, start=2):
            smiles, label = (rec[smiles_column] or "").strip(), (rec[label_column] or "").strip()
            if label not in ("0", "1"):
                raise DataError(f"{path} line {line}: label {label_column} = {label!r}, expected 0 or 1")
            mol = parse_smiles(smiles) if smiles else None
            if mol is None or mol.GetNumAtoms() == 0:
                logger.warning("%s line %d: RDKit cannot parse SMILES %r; molecule skipped", path, line, smiles)
                skipped.append((line, smiles))
                continue
            graphs.append(_graph(mol, smiles))
            labels.append(int(label))
            scaffolds.append(murcko_scaffold(mol))
            rows.append(line)
    if not graphs:
        raise DataError(f"{path}: no parsable molecule ({len(skipped)} rows skipped)")
    if skipped:
        logger.warning("%s: %d of %d molecules skipped (unparsable SMILES)", path, len(skipped), len(skipped) + len(graphs))
    return MoleculeSet(tuple(graphs), np.asarray(labels, np.int64), tuple(scaffolds),
                       np.asarray(rows, np.int64), tuple(skipped))


def scaffold_split(scaffolds: list[str] | tuple[str, ...], test_fraction: float) -> np.ndarray:
    """Boolean mask of test molecules: scaffold groups, largest first, fill train up to ``1 − test_fraction``.

    Groups are ordered by (size, index of their first molecule), descending — DeepChem's
    ``ScaffoldSplitter`` order, so among equal sizes later rows go to training first. A group
    that would push the training set past the cutoff goes to test. Every group lies wholly on
    one side.
    """
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(scaffolds):
        groups.setdefault(s, []).append(i)
    ordered = sorted(groups.values(), key=lambda g: (len(g), g[0]), reverse=True)
    cutoff = (1.0 - test_fraction) * len(scaffolds)
    test = np.zeros(len(scaffolds), dtype=bool)
    n_train = 0
    for group in ordered:
        if n_train + len(group) > cutoff:
            test[group] = True
        else:
            n_train += len(group)
    return test


CACHE_VERSION = 1


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> MoleculeSet:
    """Parsed molecules, decoded once into ``$GRAPHFL_CACHE/bbbp-<sha256>.npz`` (plain arrays, no
    pickle): parsing 2,050 SMILES costs seconds in every ClientApp process, loading the cache ~0.1 s.
    """
    import hashlib

    from graphfl.tasks.labeled import cache_dir

    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:24]
    cache = cache_dir() / f"bbbp-v{CACHE_VERSION}-{digest}.npz"
    if cache.is_file():
        try:
            return _from_arrays(cache)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("ignoring unreadable cache %s (%s)", cache, exc)
    mols = read_molecules(Path(path))
    _to_arrays(mols, cache)
    return mols


def _to_arrays(mols: MoleculeSet, cache: Path) -> None:
    import os

    g = mols.graphs
    tmp = cache.with_name(f".{cache.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, x=np.concatenate([d.x.numpy() for d in g]),
             edge_index=np.concatenate([d.edge_index.numpy() for d in g], axis=1),
             edge_attr=np.concatenate([d.edge_attr.numpy() for d in g]),
             num_nodes=np.array([d.num_nodes for d in g]), num_edges=np.array([d.edge_index.shape[1] for d in g]),
             smiles=np.array([d.smiles for d in g]), labels=mols.labels, rows=mols.rows,
             scaffolds=np.array(mols.scaffolds), skipped_rows=np.array([r for r, _ in mols.skipped], np.int64),
             skipped_smiles=np.array([s for _, s in mols.skipped], dtype=str))
    tmp.replace(cache)


def _from_arrays(cache: Path) -> MoleculeSet:
    import torch
    from torch_geometric.data import Data

    with np.load(cache, allow_pickle=False) as z:
        a = {k: z[k] for k in z.files}
    node_off = np.concatenate([[0], np.cumsum(a["num_nodes"])])
    edge_off = np.concatenate([[0], np.cumsum(a["num_edges"])])
    x, ei, ea = (torch.as_tensor(a[k]) for k in ("x", "edge_index", "edge_attr"))
    graphs = tuple(
        Data(x=x[node_off[k]:node_off[k + 1]], edge_index=ei[:, edge_off[k]:edge_off[k + 1]],
             edge_attr=ea[edge_off[k]:edge_off[k + 1]], smiles=str(a["smiles"][k]))
        for k in range(len(a["labels"]))
    )
    skipped = tuple((int(r), str(s)) for r, s in zip(a["skipped_rows"], a["skipped_smiles"]))
    return MoleculeSet(graphs, a["labels"], tuple(str(s) for s in a["scaffolds"]), a["rows"], skipped)


def collate_graphs(graphs: tuple[Any, ...]) -> Any:
    """``collate(ids)``: the PyG ``Batch`` of the molecules with these ids (indices into ``graphs``)."""
    from torch_geometric.data import Batch

    def collate(ids: np.ndarray) -> Any:
        return Batch.from_data_list([graphs[int(i)] for i in ids])

    return collate


def roc_auc(outputs: np.ndarray, targets: np.ndarray) -> float:
    """ROC-AUC of ``softmax(outputs)[:, 1]`` against 0/1 ``targets``; ``nan`` if only one class is present."""
    targets = np.asarray(targets)
    if len(targets) == 0 or len(np.unique(targets)) < 2:
        return float("nan")
    from sklearn.metrics import roc_auc_score

    logits = np.asarray(outputs, np.float64)
    score = logits[:, 1] - logits[:, 0]  # monotone in softmax(·)[:, 1]
    return float(roc_auc_score(targets, score))


class BBBP(Task):
    """MoleculeNet BBBP (2,050 rows, 11 unparsable): graph classification, 16 clients, ROC-AUC.

    Keyword options (Python API): ``encoder`` ``gin`` (default) or ``gcn``, ``hidden`` (64),
    ``layers`` (3).
    """

    spec = TaskSpec("bbbp", "classification", default_nodes=16, needs_data_dir=True,
                    summary="MoleculeNet BBBP (SMILES -> PyG graphs), scaffold split, Dirichlet split, GIN, ROC-AUC")

    def __init__(self, *args: Any, encoder: str = "gin", hidden: int = 64, layers: int = 3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if encoder not in ("gin", "gcn"):
            raise ConfigError(f"task bbbp: encoder must be one of ['gin', 'gcn'], got {encoder!r}")
        if self.data.split not in ("auto", "scaffold", "random"):
            raise ConfigError(f"task bbbp: data.split must be one of ['auto', 'scaffold', 'random'], got {self.data.split!r}")
        self.encoder, self.hidden, self.layers = encoder, int(hidden), int(layers)

    @property
    def split(self) -> str:
        return "scaffold" if self.data.split == "auto" else self.data.split

    def csv_path(self) -> Path:
        from graphfl.tasks.labeled import default_data_dir

        root = Path(self.data_dir) if self.data_dir else default_data_dir()
        return root / "bbbp" / "BBBP.csv"

    def molecules(self) -> MoleculeSet:
        """The parsed CSV (cached per process until the file changes)."""
        path = self.csv_path()
        if not path.is_file():
            read_molecules(path)  # raises the DataError naming the file
        st = path.stat()
        return _load(str(path), st.st_mtime_ns, st.st_size)

    def _pool(self) -> tuple[MoleculeSet, np.ndarray, np.ndarray]:
        """(molecules, kept molecule ids after ``data.max-samples``, test mask over all molecules)."""
        mols = self.molecules()
        keep = np.arange(len(mols.labels))
        if self.data.max_samples and self.data.max_samples < len(keep):
            keep = np.sort(client_rng(self.seed, 1).choice(len(keep), self.data.max_samples, replace=False))
        test = np.zeros(len(mols.labels), dtype=bool)
        if self.split == "scaffold":
            test[keep] = scaffold_split([mols.scaffolds[i] for i in keep], self.data.test_fraction)
        return mols, keep, test

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
        mols, keep, test = self._pool()
        parts = dirichlet_partition(mols.labels[keep], num_partitions, self.data.dirichlet_alpha,
                                    client_rng(self.seed, 1, num_partitions), min_size=self.data.min_partition_size)
        ids = keep[parts[partition_id]]
        if self.split == "scaffold":
            tr, te = ids[~test[ids]], ids[test[ids]]
        else:
            tr, te = train_test_split(ids, self.data.test_fraction, client_rng(self.seed, 2, partition_id))
        y = mols.labels
        return ClientData(tr, y[tr], te, y[te], collate=collate_graphs(mols.graphs))

    def build_model(self) -> Any:
        from graphfl.tasks.gnn_models import MoleculeNet
        from graphfl.tasks.models import seeded

        return seeded(self.seed, MoleculeNet, self.hidden, self.layers, self.encoder)

    def metrics(self, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
        return {"test_auc": roc_auc(outputs, targets)}

    def describe(self) -> dict[str, Any]:
        mols, keep, test = self._pool()
        return {
            "name": self.name, "file": str(self.csv_path()), "molecules": int(len(mols.labels)),
            "skipped_unparsable": len(mols.skipped), "skipped_rows": [r for r, _ in mols.skipped],
            "used": int(len(keep)), "split": self.split, "test_molecules": int(test[keep].sum())
            if self.split == "scaffold" else None,
            "scaffolds": len({mols.scaffolds[i] for i in keep}), "model": f"{self.encoder}-{self.layers}x{self.hidden}",
        }
