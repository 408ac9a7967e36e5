"""Shared support for the tests and the benchmarks: tolerances, tiny models, ComfyUI trees and servers."""
