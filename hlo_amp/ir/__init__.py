"""The IR helpers the passes, targets and runtime share: modules (parsing, printing,
walking, the one MLIR context, how passes hold and free ops: modules.py), op sites
(an op's location as scope, transforms and op kind: sites.py) and the op classes of
the mixed modes (op_classes.py)."""
