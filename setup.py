"Package metadata comes from settings.ini (the nbdev 2 convention)."
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=cfg['license'],
    python_requires='>=' + cfg['min_python'],
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    package_data={cfg['lib_path'] + '.syndata': ['skill_catalog/*/SKILL.md']},
    install_requires=cfg['requirements'].split(),
    extras_require={'dev': cfg['dev_requirements'].split()},
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    zip_safe=False,
)
