//! Router tests (in-memory source and store).
