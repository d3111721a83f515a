"""Replaying transcripts through the cache and measuring it: scenario files, the replay loop, the ideal
(infinite) cache, Belady's offline policy, miss explanations, report tables and plots."""
