"""The `tpserve` command and the launch of the ranks."""
