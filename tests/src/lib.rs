//! Helpers for the end-to-end tests (real server and worker processes).
