"""Generated wire contract of pscluster (see pscluster.proto); never edited by hand."""
