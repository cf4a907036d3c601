# The pure allocation core: state and messages in, decisions out.
# Rule: nothing here imports anything outside the standard library, reads a
# clock or draws a random number; `now` and new ids are always parameters.
