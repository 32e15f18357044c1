"""A captured CUDA graph's kernel nodes and edges (the CUDA driver API through ctypes), and the edit that makes an
edge programmatic: programmatic dependent launch (PDL) for a launch that PyTorch cannot make with it (cuBLAS's GEMMs).
For tools/diag/cublas_pdl_probe.py (session 32): cuBLAS 13's GEMM kernels do NOT wait, so the engine does not use it.

An edge u -> v of the programmatic type lets v's blocks launch once every block of u has triggered (or exited), not
after u has finished and flushed its writes. That is exact only if v waits (griddepcontrol.wait) before it reads
what u wrote; `cublas_pdl_probe.py` tests this of cuBLAS's kernels by a race.

A graph must be captured with `torch.cuda.CUDAGraph(keep_graph=True)` and edited before `instantiate()`.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

NODE_TYPE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
DEPENDENCY_DEFAULT, DEPENDENCY_PROGRAMMATIC = 0, 1  # CUgraphDependencyType
PORT_DEFAULT, PORT_PROGRAMMATIC = 0, 1  # CU_GRAPH_KERNEL_NODE_PORT_*


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


@functools.cache
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(name: str, *args) -> None:
    r = getattr(libcuda(), name)(*args)
    if r != 0:
        raise RuntimeError(f"{name} failed: CUresult {r}")


@dataclass(frozen=True)
class Node:
    handle: int
    name: str  # the kernel's name ("" for other nodes)
    kernel: bool


@dataclass(frozen=True)
class Edge:
    src: Node
    dst: Node
    type: int
    from_port: int


def _name(params: KernelNodeParams) -> str:
    s = ctypes.c_char_p()
    if params.func:
        _call("cuFuncGetName", ctypes.byref(s), ctypes.c_void_p(params.func))
    elif params.kern:
        _call("cuKernelGetName", ctypes.byref(s), ctypes.c_void_p(params.kern))
    return (s.value or b"").decode(errors="replace")


def _node(handle: int) -> Node:
    t = ctypes.c_int()
    _call("cuGraphNodeGetType", ctypes.c_void_p(handle), ctypes.byref(t))
    if t.value != NODE_TYPE_KERNEL:
        return Node(handle, "", False)
    p = KernelNodeParams()
    _call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(handle), ctypes.byref(p))
    return Node(handle, _name(p), True)


def kernel_nodes(graph: int) -> list[Node]:
    """The graph's kernel nodes, in the driver's order (capture order for a captured stream)."""
    n = ctypes.c_size_t(0)
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(n))
    arr = (ctypes.c_void_p * n.value)()
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), arr, ctypes.byref(n))
    return [nd for nd in (_node(h) for h in arr[:n.value]) if nd.kernel]


def edges(graph: int) -> list[Edge]:
    n = ctypes.c_size_t(0)
    _call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(n))
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (EdgeData * n.value)()
    _call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n))
    seen: dict[int, Node] = {}  # (node handles are reused once a graph is destroyed: no cache across calls)

    def node(h):
        if h not in seen:
            seen[h] = _node(h)
        return seen[h]
    return [Edge(node(src[i]), node(dst[i]), data[i].type, data[i].from_port) for i in range(n.value)]


def make_programmatic(graph: int, pred) -> int:
    """Give every ordinary kernel -> kernel edge u -> v for which pred(u, v) holds the programmatic type (v may launch
    when u's blocks trigger or exit). The graph must not be instantiated yet. Returns how many edges changed."""
    done = 0
    for e in edges(graph):
        if e.type != DEPENDENCY_DEFAULT or not (e.src.kernel and e.dst.kernel) or not pred(e.src, e.dst):
            continue
        a, b = ctypes.c_void_p(e.src.handle), ctypes.c_void_p(e.dst.handle)
        old = EdgeData(PORT_DEFAULT, 0, DEPENDENCY_DEFAULT)
        new = EdgeData(PORT_PROGRAMMATIC, 0, DEPENDENCY_PROGRAMMATIC)
        _call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(a), ctypes.byref(b),
              ctypes.byref(old), ctypes.c_size_t(1))
        _call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(a), ctypes.byref(b),
              ctypes.byref(new), ctypes.c_size_t(1))
        done += 1
    return done


CUBLAS_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk")


def is_cublas(node: Node) -> bool:
    """A cuBLAS/cuBLASLt kernel by its (mangled or plain) name. Triton kernels are named after their Python
    functions (eyas's start with "_" and no "_Z")."""
    n = node.name.lower()
    return node.kernel and (n.startswith("_z") or not n.startswith("_")) and any(m in n for m in CUBLAS_MARKS)

