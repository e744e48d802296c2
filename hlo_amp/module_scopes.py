"""Module-path named scopes for Flax NNX, Equinox, Flax Linen, Haiku and Keras models.

``with hlo_amp.module_scopes(model):`` makes every submodule call of a Flax NNX or
Equinox model run under a ``jax.named_scope`` of its path in the model (``blocks/1/attn``),
so a policy rule can name one instance (``scope:blocks/1/attn=float32``). Neither framework
names its modules by path: NNX pushes no scope, Equinox's built-in layers push their class
name. Flax Linen, Haiku and Keras 3 already scope each call by module name; for them the
helper only makes sure that is on. See docs/module_scopes.md.

How: for the duration of the context, the ``__call__`` of every module class in the model
is replaced by a wrapper (Python looks ``__call__`` up on the type, so an instance cannot be
patched alone). The wrapper scopes a call if its instance is in the model. Both frameworks
rebuild modules inside transformations (``nnx.merge``, ``nnx.jit``, ``eqx.filter_jit``,
``nnx.scan``), so paths are keyed by instance and recomputed from whichever instance of the
model's class is called: a call of the root walks that instance's submodules. A module
rebuilt inside a call (a scan over stacked layers, a remat) is matched by its structure, and
among look-alikes by its arrays' shapes, to the module of the model below the calling module
that it was made from, and gets its path (``blocks/attn`` for a stack: one path for every
layer, as the scan body is traced once).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import jax
from jax.extend import source_info_util

# Ops keep the user's line as their source, not this file's wrapper around __call__.
source_info_util.register_exclusion(__file__)

Path = tuple[str, ...]

_ACCEPTED = ("a Flax NNX or Equinox module, a Flax Linen module, a Haiku transformed function "
             "(hk.transform) or module, or a Keras 3 layer or model")


def module_scopes(model: Any) -> ModuleScopes:
    """A context manager (also a decorator) that scopes each submodule call by its path.

    Inside it, a call of a submodule of ``model`` runs under ``jax.named_scope`` segments
    of its path relative to the model root: attribute names, list indices and dict keys
    (``blocks/1/attn``). Flax NNX and Equinox modules get these paths; for Flax Linen,
    Haiku and Keras 3 models, which scope calls by module name already
    (``Model/blocks_1/attn``, ``blocks_1/attn``), it changes nothing beyond turning
    Linen's named calls on. Outputs are unchanged; only op locations differ.

    Tracing must happen inside the context: ``hlo_amp.compile(module_scopes(model)(step),
    policy)`` keeps it on for every trace. Raises ``TypeError`` for any other object.
    """
    return ModuleScopes(model, _framework(model))


def _instance_of(obj: Any, module: str, *names: str) -> bool:
    """Whether ``obj`` is an instance of ``module.name`` for one of ``names``; looked up in
    sys.modules, as an object of a framework exists only once it is imported, and hlo_amp
    must not import any framework itself."""
    found = sys.modules.get(module)
    classes = tuple(c for c in (getattr(found, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(obj, classes)


def _framework(model: Any) -> str:
    if _instance_of(model, "keras", "Layer"):  # before NNX: a Keras layer may be an NNX module
        return "keras"
    if _instance_of(model, "flax.nnx", "Module"):
        return "nnx"
    if _instance_of(model, "equinox", "Module"):
        return "equinox"
    if _instance_of(model, "flax.linen", "Module"):
        return "linen"
    if _instance_of(model, "haiku", "Transformed", "TransformedWithState", "MultiTransformed",
                    "MultiTransformedWithState", "Module"):
        return "haiku"
    if isinstance(model, type):  # the class, not a model: name it, not its metaclass
        raise TypeError(f"hlo_amp.module_scopes got the class {model.__module__}."
                        f"{model.__qualname__}, not a model; pass an instance "
                        f"({model.__qualname__}(...)); accepted: {_ACCEPTED}")
    raise TypeError(f"hlo_amp.module_scopes got an object of type "
                    f"{type(model).__module__}.{type(model).__qualname__}; accepted: {_ACCEPTED}")


# ---- the model's submodules and their paths ---------------------------------------------


def _segment(key: Any) -> str:
    """One path segment from an NNX path key or a jax.tree_util key entry."""
    if isinstance(key, (str, int)):
        return str(key)
    for attr in ("name", "idx", "key"):  # GetAttrKey, SequenceKey, DictKey/FlattenedIndexKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _submodules(kind: str, root: Any) -> list[tuple[Path, Any]]:
    """(path relative to ``root``, module) for ``root`` (path ``()``) and every submodule."""
    if kind == "nnx":
        from flax import nnx

        # iter_graph visits a shared module once, at its first path.
        return [(tuple(_segment(k) for k in path), node)
                for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)]
    import equinox as eqx

    found: list[tuple[Path, Any]] = [((), root)]

    def visit(node: Any, prefix: Path) -> None:
        # Flatten down to the next modules only, so each leaf is visited once.
        children, _ = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module))
        for keys, child in children:
            if isinstance(child, eqx.Module):
                path = prefix + tuple(_segment(k) for k in keys)
                found.append((path, child))
                visit(child, path)

    visit(root, ())
    return found


def _kind(module: Any) -> str | None:
    """``"nnx"`` or ``"equinox"`` for a module of either, else None."""
    if _instance_of(module, "flax.nnx", "Module"):
        return "nnx"
    if _instance_of(module, "equinox", "Module"):
        return "equinox"
    return None


@dataclass
class _Frame:
    """The paths of one model instance's submodules, by id, below ``base``."""

    kind: str
    root: Any
    base: Path
    model: bool  # the root is the model (or a copy of it), not a stacked layer
    paths: dict[int, Path] = field(default_factory=dict)
    modules: list[tuple[Path, Any]] = field(default_factory=list)  # keeps the ids alive
    _by_signature: dict[tuple, list[tuple[Path, Any]]] | None = None

    @classmethod
    def of(cls, kind: str, root: Any, base: Path, *, model: bool,
           modules: list[tuple[Path, Any]] | None = None) -> _Frame:
        modules = _submodules(kind, root) if modules is None else modules
        paths: dict[int, Path] = {}
        for path, module in modules:
            paths.setdefault(id(module), path)  # a shared Equinox module keeps its first path
        return cls(kind, root, base, model, paths, modules)

    def like(self, signature: tuple, shapes: dict[Path, tuple[int, ...]]) -> list[Path]:
        """Absolute paths of this frame's modules with ``signature`` whose arrays have
        ``shapes`` or are stacks of them (a scan's layer); of several that all differ,
        every one."""
        if self._by_signature is None:
            self._by_signature = {}
            for path, module in self.modules:
                below = [(p[len(path):], m) for p, m in self.modules if p[:len(path)] == path]
                self._by_signature.setdefault(_signature(module, below), []).append(
                    (path, module))
        found = self._by_signature.get(signature, [])
        fitting = [(p, m) for p, m in found if _fits(shapes, _shapes(self.kind, m))]
        if fitting or len(found) == 1:
            # One look-alike of other sizes is another module of that class (a probe the
            # step closes over), not a copy; of several, which one is unknown.
            found = fitting
        return [self.base + p for p, _ in found]


def _signature(module: Any, below: list[tuple[Path, Any]]) -> tuple:
    """The module's class and its submodules' relative paths and classes."""
    return type(module), tuple(sorted((path, type(m).__module__, type(m).__qualname__)
                                      for path, m in below))


def _shapes(kind: str, module: Any) -> dict[Path, tuple[int, ...]]:
    """The shape of each array the module holds, by its path in the module."""
    if kind == "nnx":
        from flax import nnx

        tree = nnx.state(module)
    else:
        import equinox as eqx

        tree = eqx.filter(module, eqx.is_array)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_segment(k) for k in path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in leaves}


def _fits(shapes: dict[Path, tuple[int, ...]], model: dict[Path, tuple[int, ...]]) -> bool:
    """Whether arrays of ``shapes`` can be ``model``'s own or one layer of its stack: the same
    shapes, or each with one axis fewer (the scanned one, the same for every array)."""
    if shapes.keys() != model.keys():
        return False
    if all(shapes[k] == model[k] for k in shapes):
        return True
    axes = None
    for key, shape in shapes.items():
        full = model[key]
        fit = ({i for i in range(len(full)) if full[:i] + full[i + 1:] == shape}
               if len(full) == len(shape) + 1 else set())
        axes = fit if axes is None else axes & fit
        if not axes:
            return False
    return True


@dataclass(frozen=True)
class _State:
    """What the calls in progress in this thread see: frames, and the innermost path."""

    frames: tuple[_Frame, ...] = ()
    path: Path = ()  # the segments the scoped calls in progress pushed
    owner: int | None = None  # id of the module whose call is innermost
    caller: Any = None  # that module


_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "hlo_amp_module_scopes", default=None)


def _locate(state: _State, module: Any) -> tuple[Path | None, _Frame | None]:
    """The module's absolute path, and the frame its call opens (a model copy or a module
    rebuilt by a transformation), or (None, None) for a module outside the models."""
    for frame in reversed(state.frames):
        rel = frame.paths.get(id(module))
        if rel is not None:
            path = frame.base + rel
            # A module held at several places (a projection shared by the root and its
            # blocks) has one path in the frame, the first the framework's walk met
            # (NNX's: in attribute-name order); called by a module that holds it
            # elsewhere, it takes the path through that module's own attribute.
            held = list(_holdings(state.caller, module))
            below = path[len(state.path):] if path[:len(state.path)] == state.path else None
            if not held or below in held:
                return path, None
            return state.path + held[0], None
    kind = _kind(module)
    frames = [frame for frame in state.frames if frame.kind == kind]
    if not frames:
        return None, None
    if any(frame.model and type(module) is type(frame.root) for frame in frames):
        # A copy of the model (nnx.merge, nnx.jit, a jit-rebuilt Equinox model): a new root.
        return state.path, _Frame.of(kind, module, state.path, model=True)
    own = _submodules(kind, module)
    signature = _signature(module, own)
    shapes = _shapes(kind, module)
    for frame in reversed(frames):
        candidates = frame.like(signature, shapes)
        if not candidates:
            continue
        # A layer that a scan or vmap slices lies below the module whose call runs it.
        inside = [p for p in candidates if p[:len(state.path)] == state.path]
        if len(candidates) == 1 or len(inside) == 1:
            path = inside[0] if len(inside) == 1 else candidates[0]
        else:  # one of several look-alikes (blocks/0, blocks/1): no segment of its own
            path = state.path
        return path, _Frame.of(kind, module, path, model=False, modules=own)
    return None, None


def _holdings(caller: Any, module: Any, depth: int = 3) -> Iterator[Path]:
    """The paths at which ``caller`` holds ``module``: one of its attributes, or a place
    in the lists, tuples and dicts such an attribute holds (NNX's ``List`` and ``Dict``
    among them), in attribute order."""
    if caller is None:
        return
    try:
        items = list(vars(caller).items())
    except TypeError:
        return
    yield from _held_in(items, module, depth)


def _held_in(items: list[tuple[Any, Any]], module: Any, depth: int) -> Iterator[Path]:
    for key, value in items:
        if isinstance(key, str) and key.startswith("_pytree__"):
            continue  # NNX's bookkeeping
        if value is module:
            yield (_segment(key),)
            continue
        if depth <= 0 or isinstance(value, (str, bytes)):
            continue
        if isinstance(value, Mapping):
            inner = list(value.items())
        elif isinstance(value, Sequence):
            inner = list(enumerate(value))
        else:
            continue
        for below in _held_in(inner, module, depth - 1):
            yield (_segment(key), *below)


def _scoped_call(call: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    state = _STATE.get()
    if state is None or not state.frames or state.owner == id(module):
        # No context in this thread, or super().__call__ of the module being called.
        return call(module, *args, **kwargs)
    path, frame = _locate(state, module)
    if path is None:
        return call(module, *args, **kwargs)
    if path[:len(state.path)] == state.path:
        push = path[len(state.path):]
    else:  # called from outside its parent: its whole path goes below the current one
        push, path = path, state.path + path
        if frame is not None:
            frame.base = path
    frames = state.frames + ((frame,) if frame is not None else ())
    token = _STATE.set(_State(frames, path, id(module), module))
    try:
        with contextlib.ExitStack() as scopes:
            for segment in push:
                scopes.enter_context(jax.named_scope(segment))
            return call(module, *args, **kwargs)
    finally:
        _STATE.reset(token)


# ---- patching the module classes' __call__, counted across contexts and threads ----------

_LOCK = threading.Lock()
_PATCHED: dict[type, list[Any]] = {}  # class -> [its own __call__ entry, contexts using it]


def _owners(modules: list[tuple[Path, Any]]) -> list[type]:
    """The classes that define the ``__call__`` each module runs."""
    owners: dict[type, None] = {}
    for _, module in modules:
        owner = next((k for k in type(module).__mro__ if "__call__" in k.__dict__), None)
        if owner is not None and owner is not object:
            owners[owner] = None
    return list(owners)


def _wrapper(original: Any) -> Callable[..., Any]:
    def call(module: Any, *args: Any, **kwargs: Any) -> Any:
        return original.__get__(module, type(module))(*args, **kwargs)

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _scoped_call(call, self, args, kwargs)

    return __call__


def _patch(classes: list[type]) -> list[type]:
    """Wrap each class's ``__call__``; returns the classes wrapped (a class that refuses new
    attributes, such as one written in C, is left alone: its modules get no scope)."""
    done = []
    with _LOCK:
        for cls in classes:
            entry = _PATCHED.get(cls)
            if entry is None:
                original = cls.__dict__["__call__"]
                try:
                    cls.__call__ = _wrapper(original)
                except (TypeError, AttributeError):
                    continue
                _PATCHED[cls] = [original, 0]
                entry = _PATCHED[cls]
            entry[1] += 1
            done.append(cls)
    return done


def _unpatch(classes: list[type]) -> None:
    with _LOCK:
        for cls in classes:
            entry = _PATCHED[cls]
            entry[1] -= 1
            if entry[1] == 0:
                cls.__call__ = entry[0]
                del _PATCHED[cls]


# ---- the context manager ---------------------------------------------------------------


class ModuleScopes(contextlib.ContextDecorator):
    """What ``module_scopes(model)`` returns: enter it with ``with``, or decorate a function."""

    def __init__(self, model: Any, kind: str):
        self.model = model
        self.kind = kind
        self._open: list[contextlib.ExitStack] = []

    def _recreate_cm(self) -> ModuleScopes:
        return ModuleScopes(self.model, self.kind)  # a decorated function may run in threads

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._scopes())
            self._open.append(stack.pop_all())
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.pop().__exit__(*exc)

    @contextlib.contextmanager
    def _scopes(self) -> Iterator[None]:
        if self.kind == "linen":
            from flax import linen

            with linen.override_named_call(True):  # Linen scopes calls only when it is on
                yield
            return
        if self.kind not in ("nnx", "equinox"):  # Haiku and Keras always scope by name
            yield
            return
        state = _STATE.get() or _State()
        frame = _Frame.of(self.kind, self.model, state.path, model=True)
        classes = _patch(_owners(frame.modules))
        token = _STATE.set(_State(state.frames + (frame,), state.path, state.owner))
        try:
            yield
        finally:
            _STATE.reset(token)
            _unpatch(classes)

    def __repr__(self) -> str:
        return f"hlo_amp.module_scopes(<{self.kind} {type(self.model).__qualname__}>)"
