NOTE = "not imported by the network"
