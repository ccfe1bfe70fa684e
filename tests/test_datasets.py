"""Dataset loaders: data-root resolution and its errors, the README's statistics for every
shipped graph, Kipf's Planetoid conventions re-derived independently, MNIST, SuiteSparse and
DLMC listings, the pickle allow-list, and that nothing is ever written into the data."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import sparsetorch.datasets as D
from sparsetorch.datasets import _paths
from sparsetorch.datasets._pickle import load_pickle
from sparsetorch.formats import SparseTensor


def _root():
    try:
        return D.data_root()
    except FileNotFoundError as e:
        pytest.skip(f"shipped data not found: {e}")


@pytest.fixture(scope="module")
def root():
    return _root()


# -- data root -------------------------------------------------------------------------------
def test_root_argument_and_env(tmp_path, monkeypatch):
    (tmp_path / "planetoid").mkdir()
    assert D.data_root(tmp_path) == tmp_path
    monkeypatch.setenv("SPARSETORCH_DATA", str(tmp_path))
    assert D.data_root() == tmp_path
    (tmp_path / "inner" / "mnist").mkdir(parents=True)
    assert D.data_root(tmp_path / "inner") == tmp_path / "inner"   # root= beats the env


def test_a_named_folder_without_datasets_is_an_error(tmp_path, monkeypatch):
    """A folder one level too high (or an unrelated one) named as the data root: every
    loader said "missing" and the bench ran on stand-ins; it is an error that points at the
    data folder inside where there is one."""
    (tmp_path / "shared" / "data" / "planetoid").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"holds none of the dataset folders.*"
                                                r"did you mean '.*shared/data'"):
        D.data_root(tmp_path)
    monkeypatch.setenv("SPARSETORCH_DATA", str(tmp_path / "shared"))
    with pytest.raises(FileNotFoundError, match=r"SPARSETORCH_DATA=.*holds none.*"
                                                r"did you mean '.*shared/data'"):
        D.data_root()
    with pytest.raises(ValueError, match="root='' names no folder"):
        D.data_root("")


def test_root_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"root='.*nowhere' is not a folder.*"
                                                r"SPARSETORCH_DATA="):
        D.data_root(tmp_path / "nowhere")
    monkeypatch.setenv("SPARSETORCH_DATA", str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match=r"SPARSETORCH_DATA='.*gone' is not a folder"):
        D.data_root()
    monkeypatch.delenv("SPARSETORCH_DATA")
    looked = [tmp_path / "a" / "shared" / "data", tmp_path / "shared" / "data"]
    monkeypatch.setattr(_paths, "_candidates", lambda: looked)
    with pytest.raises(FileNotFoundError) as e:
        D.data_root()
    msg = str(e.value)
    assert all(str(p) in msg for p in looked) and "set SPARSETORCH_DATA=" in msg
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert D.data_root() == tmp_path / "shared" / "data"


def test_candidates_include_repo_sibling():
    src = Path(D.__file__).resolve()
    assert src.parents[4] / "shared" / "data" in _paths._candidates()   # <repo>/../shared


def test_loaders_say_what_is_missing(tmp_path):
    (tmp_path / "dlmc").mkdir()   # (a data folder must hold one dataset's folder)
    other = tmp_path / "other"
    (other / "mnist").mkdir(parents=True)
    for call, missing in [(lambda: D.planetoid("cora", root=tmp_path), "planetoid"),
                          (lambda: D.graph("amazon_cs", root=tmp_path), "graphs"),
                          (lambda: D.mnist(root=tmp_path), "mnist"),
                          (lambda: D.suitesparse(root=tmp_path), "suitesparse"),
                          (lambda: D.dlmc(root=other), "dlmc")]:
        with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist.*"
                                                    "SPARSETORCH_DATA"):
            call()
    (tmp_path / "planetoid").mkdir()
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.y, which is missing"):
        D.planetoid("cora", root=tmp_path)
    (tmp_path / "mnist").mkdir()
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.gz nor"):
        D.mnist(root=tmp_path)


def test_unknown_names(root):
    with pytest.raises(ValueError, match="unknown dataset 'reddit'; use one of cora"):
        D.graph("reddit")
    with pytest.raises(ValueError, match="use one of cora, citeseer, pubmed"):
        D.planetoid("amazon_cs")
    with pytest.raises(ValueError, match="use 'computers' or 'photo'"):
        D.amazon("cs")
    with pytest.raises(ValueError, match="only 'cs' is shipped"):
        D.coauthor("physics")


# -- graphs: the README table ----------------------------------------------------------------
TABLE = {  # name: nodes, edge entries, features, classes
    "cora": (2708, 10556, 1433, 7), "citeseer": (3327, 9104, 3703, 6),
    "pubmed": (19717, 88648, 500, 3), "amazon_cs": (13752, 491722, 767, 10),
    "amazon_photo": (7650, 238162, 745, 8), "coauthor_cs": (18333, 163788, 6805, 15),
}


@pytest.fixture(scope="module")
def graphs(root):
    return {name: D.graph(name) for name in TABLE}


@pytest.mark.parametrize("name", list(TABLE))
def test_graph_statistics(graphs, name):
    g = graphs[name]
    nodes, edges, feats, classes = TABLE[name]
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == TABLE[name]
    assert g.name == name and name in repr(g)
    adj = g.adj
    assert isinstance(adj, SparseTensor) and adj.format.name == "csr"
    assert adj.dtype == torch.float32 and adj.shape == (nodes, nodes)
    s = adj.to_scipy()
    assert (s != s.T).nnz == 0                          # symmetric
    assert s.diagonal().sum() == 0                      # no self-loops
    assert np.all(s.data == 1) and s.has_canonical_format  # deduplicated
    assert g.labels.dtype == torch.int64 and g.labels.shape == (nodes,)
    assert int(g.labels.min()) == 0 and int(g.labels.max()) == classes - 1
    if name == "pubmed":
        assert g.features is None                       # ind.pubmed.allx is not shipped
    else:
        assert g.features.format.name == "csr" and g.features.dtype == torch.float32
        assert g.features.shape == (nodes, feats)


@pytest.mark.parametrize("name", ["cora", "citeseer", "pubmed"])
def test_planetoid_split(graphs, name):
    g = graphs[name]
    n_train = {"cora": 140, "citeseer": 120, "pubmed": 60}[name]
    assert torch.equal(g.train_idx, torch.arange(n_train))
    assert torch.equal(g.val_idx, torch.arange(n_train, n_train + 500))
    assert len(g.test_idx) == 1000 and bool((g.test_idx[1:] > g.test_idx[:-1]).all())
    masks = torch.stack([g.train_mask, g.val_mask, g.test_mask])
    assert masks.sum(1).tolist() == [n_train, 500, 1000] and int(masks.sum(0).max()) == 1


def _kipf(root, name):
    """Kipf's gcn/utils.py load_data, transcribed (with scipy.sparse for the features)."""
    def load(key):
        return load_pickle(root / "planetoid" / f"ind.{name}.{key}")

    x, y, tx, ty, allx, ally = (load(k) for k in ("x", "y", "tx", "ty", "allx", "ally"))
    test_idx_reorder = np.loadtxt(root / "planetoid" / f"ind.{name}.test.index", dtype=int)
    test_idx_range = np.sort(test_idx_reorder)
    if name == "citeseer":
        full = range(min(test_idx_reorder), max(test_idx_reorder) + 1)
        tx_ext = sp.lil_matrix((len(full), x.shape[1]))
        tx_ext[test_idx_range - min(test_idx_range), :] = tx
        tx = tx_ext
        ty_ext = np.zeros((len(full), y.shape[1]))
        ty_ext[test_idx_range - min(test_idx_range), :] = ty
        ty = ty_ext
    features = sp.vstack((allx, tx)).tolil()
    features[test_idx_reorder, :] = features[test_idx_range, :]
    labels = np.vstack((ally, ty))
    labels[test_idx_reorder, :] = labels[test_idx_range, :]
    return features.tocsr(), labels.argmax(1)


@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_planetoid_matches_kipf(root, graphs, name):
    features, labels = _kipf(root, name)
    g = graphs[name]
    assert np.array_equal(g.labels.numpy(), labels)
    assert (g.features.to_scipy() != features.astype(np.float32)).nnz == 0


def test_graph_helpers_and_aliases(graphs):
    assert D.amazon("computers").num_edges == graphs["amazon_cs"].num_edges
    assert D.amazon("Photo").num_nodes == 7650
    assert D.coauthor().num_nodes == 18333
    assert D.graph("Amazon-Computers").name == "amazon_cs"
    assert graphs["amazon_cs"].train_idx is None and graphs["amazon_cs"].train_mask is None
    assert "no standard split" in repr(graphs["amazon_cs"])


def test_graph_matches_readme_loader(root, graphs):
    """The README's symmetrisation, from scipy: A + A^T, no self-loops, entries 1."""
    from sparsetorch.datasets._pickle import load_npz

    a = load_npz(root / "graphs" / "coauthor_cs.npz", ["adj_matrix"])["adj_matrix"].item()
    ref = ((a + a.T) != 0).astype(np.float32).tolil()
    ref.setdiag(0)
    ref = ref.tocsr()
    ref.eliminate_zeros()
    assert (graphs["coauthor_cs"].adj.to_scipy() != ref).nnz == 0


# -- MNIST -----------------------------------------------------------------------------------
def test_mnist(root):
    X, y = D.mnist()
    assert X.shape == (60000, 28, 28) and X.dtype == torch.uint8 and y.dtype == torch.int64
    assert abs(X.float().mean().item() / 255 - 0.1307) < 1e-4
    assert y.bincount().tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    Xt, yt = D.mnist(train=False, dtype=torch.float32)
    assert Xt.shape == (10000, 28, 28) and yt.shape == (10000,)
    assert Xt.dtype == torch.float32 and float(Xt.max()) == 1.0
    assert abs(Xt.mean().item() - 0.1325) < 1e-3
    with pytest.raises(TypeError, match="dtype=torch.int32 is not supported"):
        D.mnist(dtype=torch.int32)
    for dtype in ("float32", None):   # (an AttributeError on the string)
        with pytest.raises(TypeError, match=f"dtype={dtype} is not supported"):
            D.mnist(dtype=dtype)


def test_mnist_bad_file(tmp_path):
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x01" + b"\0" * 8)
    with pytest.raises(ValueError, match="magic 2049, expected 2051"):
        D.mnist(root=tmp_path, train=False)
    # the right magic, cut inside the header (it said 'magic 2051, expected 2051')
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03\0\0\0")
    with pytest.raises(ValueError, match="holds 7 bytes, fewer than its 16-byte header"):
        D.mnist(root=tmp_path, train=False)
    # a .gz that is no gzip file (a fuzzer's finding: gzip's bare BadGzipFile)
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz").write_bytes(b"hello")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz is not a readable gzip"):
        D.mnist(root=tmp_path, train=False)


@pytest.mark.usefixtures("tiny_sizes")
def test_files_of_another_size_are_refused(tmp_path):
    """(A probe's findings: CiteSeer's test.index under Cora's name loaded a 3327-node
    "Cora", ty copied over y a 1000-node training split, coauthor_cs.npz renamed
    amazon_photo.npz loaded as Amazon Photo: each is now checked against the dataset's
    known sizes.)"""
    parts = _planetoid_parts()
    parts["y"] = parts["y"][:1]
    _write_planetoid(tmp_path, parts)
    with pytest.raises(ValueError, match=r"ind\.cora\.\*: 6 nodes, 3 features, 2 classes, 1 "
                                         r"training nodes, but cora has .* 2 training nodes"):
        D.planetoid("cora", root=tmp_path)
    _write_npz_graph(tmp_path, node_label=np.array([0, 1, 1, 3]))
    with pytest.raises(ValueError, match=r"amazon_photo.npz: 4 nodes, 3 features, 4 classes"):
        D.graph("amazon_photo", root=tmp_path)


def _write_idx(path, magic, array):
    import struct
    path.write_bytes(struct.pack(">i", magic) + b"".join(struct.pack(">i", d)
                                                          for d in array.shape)
                     + array.astype(np.uint8).tobytes())


def test_mnist_of_another_count_or_a_label_past_9_is_refused(tmp_path):
    """(A probe's findings: the training files in the test files' place gave 60000 "test"
    digits; a label byte of 200 came back as label 200.)"""
    folder = tmp_path / "mnist"
    folder.mkdir()
    _write_idx(folder / "t10k-images-idx3-ubyte", 2051, np.zeros((3, 28, 28)))
    _write_idx(folder / "t10k-labels-idx1-ubyte", 2049, np.zeros(3))
    with pytest.raises(ValueError, match=r"holds \(3, 28, 28\) images and 3 labels .*expected "
                                         "10000 28x28"):
        D.mnist(root=tmp_path, train=False)
    _write_idx(folder / "t10k-images-idx3-ubyte", 2051, np.zeros((10000, 28, 28)))
    labels = np.arange(10000) % 10
    labels[17] = 200
    _write_idx(folder / "t10k-labels-idx1-ubyte", 2049, labels)
    with pytest.raises(ValueError, match="holds label 200; digits are labelled 0-9"):
        D.mnist(root=tmp_path, train=False)
    labels[17] = 7
    _write_idx(folder / "t10k-labels-idx1-ubyte", 2049, labels)
    assert D.mnist(root=tmp_path, train=False).labels[17] == 7


# -- SuiteSparse and DLMC listings -----------------------------------------------------------
def test_suitesparse(root):
    names = D.suitesparse()
    assert len(names) == 59 and names == sorted(names) and "HB__bcsstk13" in names
    usable = D.suitesparse(fields=("real", "integer", "pattern"))
    assert len(usable) == 58 and "HB__young1c" not in usable
    a = D.suitesparse("bcsstk13", dtype=torch.float32)
    assert a.shape == (2003, 2003) and a.nnz == 83883 and a.dtype == torch.float32
    assert D.suitesparse("HB/bcsstk13", format="coo").format.name == "coo"
    with pytest.raises(ValueError, match="did you mean HB__bcsstk13"):
        D.suitesparse("bcsstk31")


def test_suitesparse_ambiguous_name(tmp_path):
    folder = tmp_path / "suitesparse" / "mtx"
    folder.mkdir(parents=True)
    for group in ("A", "B"):
        (folder / f"{group}__x.mtx").write_text(
            "%%MatrixMarket matrix coordinate pattern general\n1 1 1\n1 1\n")
    with pytest.raises(ValueError, match=r"'x' is ambiguous \(A__x, B__x\)"):
        D.suitesparse("x", root=tmp_path)
    assert D.suitesparse("B/x", root=tmp_path).nnz == 1


def test_dlmc(root):
    counts = {("transformer", "0.7"): 96, ("transformer", "0.9"): 96,
              ("transformer", "0.98"): 97, ("rn50", "0.8"): 54, ("rn50", "0.9"): 54,
              ("rn50", "0.98"): 54}
    for (model, level), n in counts.items():
        paths = D.dlmc(model, sparsity=level)
        assert len(paths) == n and all(p.name.endswith(".smtx.gz") for p in paths)
    assert D.dlmc("rn50", sparsity=0.98) == D.dlmc("rn50", sparsity="0.98")
    assert D.dlmc() == D.dlmc("transformer", "magnitude_pruning", 0.9)
    with pytest.raises(FileNotFoundError, match=r"shipped sets .*rn50/magnitude_pruning/0\.8"):
        D.dlmc("rn50", sparsity=0.5)


# -- safety ----------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_allow_list_refuses_code(tmp_path):
    path = tmp_path / "ind.cora.x"
    path.write_bytes(pickle.dumps(_Evil(), protocol=2))
    with pytest.raises(ValueError, match="refusing to load"):
        load_pickle(path)


def test_never_writes_into_the_data(root, graphs):
    def snapshot():
        return sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))

    before = snapshot()
    D.graph("cora")
    D.mnist(train=False)
    D.suitesparse("karate")
    D.dlmc("rn50")
    assert snapshot() == before


# -- tampered Planetoid parts: checked before scipy sees them ---------------------------------
def _csr(dense, **tamper):
    """A csr_matrix of ``dense`` with raw attributes replaced, as a tampered pickle would
    restore it (unpickling sets attributes without the constructor's checks)."""
    m = sp.csr_matrix(np.asarray(dense, np.float32))
    m.__dict__.update(tamper)
    return m


def _planetoid_parts():
    """A tiny consistent Planetoid set: 4 labelled nodes (2 train), 2 test nodes, 3 features."""
    eye = np.eye(2, dtype=np.int32)
    return {"x": _csr([[1, 0, 0], [0, 1, 0]]), "y": eye,
            "allx": _csr([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]]),
            "ally": np.vstack([eye, eye]), "tx": _csr([[0, 0, 2], [3, 0, 0]]), "ty": eye[::-1],
            "graph": {0: [1, 5], 1: [0], 2: [3], 3: [2], 4: [5], 5: [0, 4]}}


@pytest.fixture
def tiny_sizes(monkeypatch):
    """The tiny sets below pass for Cora and Amazon Photo (whose real sizes are checked)."""
    from sparsetorch.datasets import _graph
    monkeypatch.setitem(_graph.SIZES, "cora", (6, 3, 2, 2))
    monkeypatch.setitem(_graph.SIZES, "amazon_photo", (4, 3, 3, None))


def _write_planetoid(root, parts, test_index="5\n4\n"):
    folder = root / "planetoid"
    folder.mkdir(exist_ok=True)
    for k, obj in parts.items():
        (folder / f"ind.cora.{k}").write_bytes(pickle.dumps(obj, protocol=3))
    (folder / "ind.cora.test.index").write_text(test_index)


@pytest.mark.usefixtures("tiny_sizes")
def test_tiny_planetoid_set_loads(tmp_path):
    _write_planetoid(tmp_path, _planetoid_parts())
    g = D.planetoid("cora", root=tmp_path)
    assert g.num_nodes == 6 and g.labels.tolist() == [0, 1, 0, 1, 0, 1]
    assert g.features.to_dense()[5].tolist() == [0, 0, 2]       # tx row 0 is node 5
    assert g.features.to_dense()[4].tolist() == [3, 0, 0]


_BAD_PARTS = [
    ("allx", lambda: _csr(np.eye(4, 3), indptr=np.array([0, 1, 2, 3, 1 << 30], np.int32)),
     r"ind\.cora\.allx: the matrix's indptr .* not a pointer over 4 rows and 3 entries"),
    ("allx", lambda: _csr(np.eye(4, 3), indptr=np.array([0, 2, 1, 3, 3], np.int32)),
     "not a pointer"),
    ("tx", lambda: _csr([[0, 0, 2], [3, 0, 0]], indices=np.array([2, 1 << 30], np.int32)),
     r"ind\.cora\.tx: the matrix's indices \(2 values\) are not 2 indices in \[0, 3\)"),
    ("tx", lambda: _csr([[0, 0, 2], [3, 0, 0]], data=np.array(["a", "b"], object)),
     r"data is a 1-D object array, expected a 1-D numeric array"),
    ("tx", lambda: _csr([[0, 0, 2], [3, 0, 0]], _shape=(2, -3)), r"shape \(2, -3\)"),
    ("x", lambda: np.eye(2), r"ind\.cora\.x holds a ndarray of shape None"),
    ("x", lambda: _csr([[1, 0, 0], [0, 1, 0]], indices=[0, 1]), "indices is list"),
    ("ally", lambda: np.arange(4), r"ind\.cora\.ally holds a 1-D int64 array, expected a 2-D"),
    ("ty", lambda: np.array([[None, 1]]), "object array"),
    ("ty", lambda: np.eye(3, dtype=np.int32), r"ty has 3 rows and ally 4"),
    ("ally", lambda: np.eye(4, 3, dtype=np.int32), r"shapes .* do not fit together"),
    ("tx", lambda: _csr(np.eye(2, 4)), r"shapes .* do not fit together"),
    ("graph", lambda: [[1], [0]], r"ind\.cora\.graph holds a list that does not map"),
    ("graph", lambda: {0: [1.5]}, "does not map node ids"),
    ("graph", lambda: {0: [1 << 40]}, r"names a node outside \[0, 6\)"),
    ("graph", lambda: {0: [1 << 70]}, "does not map node ids"),   # (numpy's OverflowError)
    # (a flipped byte in a label matrix: argmax made it a plausible label)
    ("ally", lambda: np.array([[1, 0], [0, -16777216], [1, 0], [0, 1]]), "must be one-hot"),
    ("y", lambda: np.array([[1, 1], [0, 1]]), "must be one-hot"),
]


@pytest.mark.usefixtures("tiny_sizes")
@pytest.mark.parametrize("part, bad, message", _BAD_PARTS)
def test_tampered_planetoid_parts_are_refused(tmp_path, part, bad, message):
    parts = _planetoid_parts()
    parts[part] = bad()
    _write_planetoid(tmp_path, parts)
    with pytest.raises(ValueError, match=message) as e:
        D.planetoid("cora", root=tmp_path)
    assert "planetoid('cora')" in str(e.value)


@pytest.mark.usefixtures("tiny_sizes")
@pytest.mark.parametrize("data", [b"\x80\x02K\x01)R.",   # calls an int: a TypeError
                                  b"\x80\x02cbuiltins\nset\n)R]a.",   # appends to a set
                                  b"\x80\x02X\xff\xff\xff\x7f"])   # a 2 GiB string
def test_a_damaged_pickle_is_a_value_error(tmp_path, data):
    _write_planetoid(tmp_path, _planetoid_parts())
    (tmp_path / "planetoid" / "ind.cora.graph").write_bytes(data)
    with pytest.raises(ValueError, match=r"cannot read .*ind\.cora\.graph.*restore it"):
        D.planetoid("cora", root=tmp_path)


@pytest.mark.usefixtures("tiny_sizes")
@pytest.mark.parametrize("test_index, message", [
    ("", "lists 0 nodes"), ("5\n5\n", "2 distinct nodes"), ("3\n4\n", "from 3 to 4"),
    ("5\n1000000000000\n", r"2 distinct nodes in \[4, 8\)"),
    ("5\nsix\n", r"test.index must hold node ids"),   # (numpy's error, no file, before)
    ("5\n99999999999999999999\n", r"test.index must hold node ids")])   # (OverflowError)
def test_bad_test_index_is_refused(tmp_path, test_index, message):
    _write_planetoid(tmp_path, _planetoid_parts(), test_index)
    with pytest.raises(ValueError, match=message):
        D.planetoid("cora", root=tmp_path)


def _write_npz_graph(root, **replace):
    """A 4-node graph in the Amazon/Coauthor npz layout, ``replace``'s arrays swapped in."""
    adj = sp.csr_matrix(np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 0]],
                                 np.float32))
    arrays = {"adj_matrix": adj, "node_attr": sp.csr_matrix(np.eye(4, 3, dtype=np.float32)),
              "node_label": np.array([0, 1, 1, 2]), **replace}
    (root / "graphs").mkdir(exist_ok=True)
    np.savez(root / "graphs" / "amazon_photo.npz",
             **{k: np.array(v, dtype=object) if sp.issparse(v) else v
                for k, v in arrays.items()})


@pytest.mark.usefixtures("tiny_sizes")
@pytest.mark.parametrize("replace, message", [
    ({}, None),
    ({"node_attr": sp.csr_matrix(np.eye(3, 3, dtype=np.float32))}, "has 3 rows for 4 nodes"),
    ({"node_label": np.array([0, -1, 1, 2])}, "node_label holds -1"),
    ({"node_label": np.array([0, 1.5, 1, 2])}, "node_label holds 1.5"),
])
def test_npz_graphs_check_features_and_labels_against_the_nodes(tmp_path, replace, message):
    """(Features with fewer rows than nodes, a negative label, fractional labels: each
    loaded, to fail later inside a model.)"""
    _write_npz_graph(tmp_path, **replace)
    if message is None:
        g = D.graph("amazon_photo", root=tmp_path)
        assert g.num_nodes == 4 and g.labels.tolist() == [0, 1, 1, 2]
        return
    with pytest.raises(ValueError, match=message):
        D.graph("amazon_photo", root=tmp_path)


def test_loader_arguments_that_named_nothing_are_errors(tmp_path):
    """(A probe: ``train="no"`` gave the training set, ``fields="bogus"`` and a model of
    ``"../.."`` an empty list, ``sparsity=None`` float()'s bare TypeError.)"""
    for sub in ("mnist", "dlmc", "suitesparse/mtx"):
        (tmp_path / sub).mkdir(parents=True)
    with pytest.raises(TypeError, match="mnist: train must be True or False, got 'no'"):
        D.mnist(root=tmp_path, train="no")
    with pytest.raises(ValueError, match="fields='bogus'; Matrix Market fields are complex"):
        D.suitesparse(root=tmp_path, fields="bogus")
    assert D.suitesparse(root=tmp_path, fields=("real", "pattern")) == []
    for kwargs in ({"model": "../.."}, {"pruning": "."}, {"sparsity": "0.9/.."}):
        with pytest.raises(ValueError, match="is not the name of a shipped set"):
            D.dlmc(root=tmp_path, **kwargs)
    with pytest.raises(TypeError, match="dlmc: sparsity must be a number"):
        D.dlmc(root=tmp_path, sparsity=None)
