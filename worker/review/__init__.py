"""Looking at answers: a job's review site (`visbatch view`), two runs side by side (`visbatch compare`).

Light on purpose: the standard library's http.server, PIL for thumbnails, the database and the
object store. Nothing here imports torch or transformers (tests/test_review_site.py checks it).
"""
