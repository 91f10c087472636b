"""What dvc.yaml and the code manifests are made from: the rendered stages (``dvcfile``), each stage kind's code
from the import graph (``code_graph``) and its hash (``code_hash``), the manifests themselves (``code_manifest``),
the library versions they record (``libraries``) and the checks of a project's files (``project_checks``)."""
