"""Where each rank sits: the GPU's place in the PCIe fabric read from sysfs (:mod:`.sysfs`), peer
access and the islands the ranks form (:mod:`.topology`), and the node each rank runs on
(:mod:`.nodes`). Facts only: which algorithm a fabric calls for is the plan's choice."""
