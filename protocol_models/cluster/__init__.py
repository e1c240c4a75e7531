"""Before and around a cluster run: the dry-run planner (``plan``), a target cluster's link
emulated on a small machine (``emulate``), the GPU check (``gpu_check``) with its checklist
(``checklist``) and FSDP probe (``fsdp_probe``), and the launcher (``launch``)."""
