"""Names of the files an export folder holds, which the export writes and the runtime finds."""

# the data file (`{FOUNDATION}.ptd`) of a program exported with external_weights, beside its
# model.pte: every weight, which the base model's adapters will share
FOUNDATION = "foundation"
