"""The operator's console (issue 29): a page at /ui on every ingress that shows the residency policy at
work in words, beside the Ray dashboard. What it shows is composed here from the residency service's
views (`view.py`), its events and decisions are put in sentences here (`wording.py`), the page itself
is plain files (`static/`: HTML, CSS and JavaScript, no build step, nothing fetched from elsewhere),
and the screenshots in docs/ are made by `screenshot.py` (and the dashboard's by
`dashboard_screenshot.py`). The routes that serve all of it are router/api/routes/console.py."""
